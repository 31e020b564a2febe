"""The work protocol's model (``work_protocol``), explored exhaustively within bounds: the
correct rules hold every invariant, and each broken variant is caught with a counterexample."""

from __future__ import annotations

import pytest
from work_protocol import (
    DATABASE,
    EXTERNAL,
    EXTERNAL_ONCE,
    HUMAN_VERDICT_STANDS,
    IDEMPOTENT,
    IDEMPOTENT_RETRY,
    INVARIANTS,
    MAX_DELIVERIES,
    MODEL_ONLY_STEPS,
    NO_VERB_UNDER_LIVE_LEASE,
    NOT_MODELLED,
    ONE_LIVE_HOLDER,
    OWNED_NOT_DEAD_LETTERED,
    QUIET_MEANS_SETTLED,
    RETRY,
    VARIANTS,
    Bounds,
    Protocol,
    Report,
    explore,
    main,
)

from infrai_jobs.queue_contract import MAX_RECEIVE_COUNT
from infrai_jobs.work.states import WORK_TRANSITIONS

# The default bounds: two keys (an irreversible job, and one with a retry policy), three
# actors alive at once, 14 steps, one death. About 4 s on two cores.
DEFAULT = Bounds()


def _shown(report: Report) -> Report:
    print(report.summary())  # the figures, shown with -s
    return report


@pytest.fixture(scope="module")
def default_run() -> Report:
    return _shown(explore(Protocol(DEFAULT)))


@pytest.fixture(scope="module")
def other_classes_run() -> Report:
    """A database job and a key-passing job, deeper (their spaces are small)."""
    return _shown(explore(Protocol(Bounds(kinds=(DATABASE, IDEMPOTENT), steps=16))))


@pytest.fixture(scope="module")
def retried_key_passing_run() -> Report:
    """A key-passing job with a retry policy, published twice (a producer's retry), deep
    enough that a dead letter is taken back from its own claim."""
    bounds = Bounds(kinds=(IDEMPOTENT_RETRY,), copies=2, steps=20)
    return _shown(explore(Protocol(bounds)))


@pytest.mark.slow
def test_the_correct_rules_hold_every_invariant_at_the_default_bounds(default_run: Report) -> None:
    # Given the correct rules, explored over every interleaving up to the default bounds
    # Then no invariant is violated, every step was explored, and the space is not trivial
    assert default_run.ok, "\n".join([default_run.summary(), *default_run.trace])
    assert default_run.depth == DEFAULT.steps
    assert default_run.states > 50_000
    assert default_run.quiet_states > 0


@pytest.mark.slow
def test_the_exploration_reaches_every_transition_it_models(
    default_run: Report, other_classes_run: Report, retried_key_passing_run: Report
) -> None:
    # Given the default run and the runs of the other kinds of job
    runs = (default_run, other_classes_run, retried_key_passing_run)
    reached = {verb for run in runs for verb in run.verbs}
    # Then every transition of the production table but prune was made somewhere
    production = {name for t in WORK_TRANSITIONS for name in t.action.split(", ")}
    assert production - reached == set(NOT_MODELLED)
    # And the model names no transition the production table does not have
    assert reached - production <= set(MODEL_ONLY_STEPS)


def test_the_other_effect_classes_hold_every_invariant(other_classes_run: Report) -> None:
    # Given a database job and a key-passing job, explored 16 steps deep
    # Then nothing is violated
    report = other_classes_run
    assert report.ok, "\n".join([report.summary(), *report.trace])
    assert report.depth == 16
    assert report.states > 10_000


@pytest.mark.slow
def test_a_retried_key_passing_job_published_twice_holds_every_invariant(
    retried_key_passing_run: Report,
) -> None:
    # Given a key-passing job with a retry policy, two messages of it, 20 steps
    # Then nothing is violated, and its dead letter was taken back from its own expired claim
    report = retried_key_passing_run
    assert report.ok, "\n".join([report.summary(), *report.trace])
    assert report.states > 20_000
    assert report.verbs["take back a dead letter (takeover)"] > 0


@pytest.mark.slow
def test_a_producer_retry_holds_every_invariant() -> None:
    # Given each key published twice (a producer's retry), less deep
    report = _shown(explore(Protocol(Bounds(copies=2, steps=10))))
    # Then nothing is violated
    assert report.ok, "\n".join([report.summary(), *report.trace])
    assert report.states > 30_000


@pytest.mark.parametrize(
    ("variant", "invariant", "within"),
    [
        ("a", NO_VERB_UNDER_LIVE_LEASE, 8),  # a reconcile releases a live deferred run
        ("b", OWNED_NOT_DEAD_LETTERED, 10),  # deferral only at the last delivery
        ("c", NO_VERB_UNDER_LIVE_LEASE, 3),  # the operator reads a NULL lease as over
        ("d", HUMAN_VERDICT_STANDS, 9),  # a plain redrive reopens a human's verdict
        ("e", EXTERNAL_ONCE, 10),  # a probe's answer from under a live lease
        ("f", HUMAN_VERDICT_STANDS, 14),  # a plain redrive judges the letter, not the claim
    ],
)
def test_each_broken_variant_is_caught_with_a_counterexample(
    variant: str, invariant: str, within: int
) -> None:
    # Given a variant with one guard swapped, at the default bounds
    report = _shown(explore(VARIANTS[variant](DEFAULT)))
    # Then the checker stops at a violation of the invariant that guard protects, with the
    # shortest trace that reaches it (the initial state, then one line per step)
    assert report.violation == invariant, report.summary()
    assert 2 <= len(report.trace) <= within + 1
    assert report.trace[0].startswith(" 0. initial state")


def test_the_counterexamples_tell_the_story_of_each_bug() -> None:
    # Given the three bugs the brief names
    traces = {v: "\n".join(explore(VARIANTS[v](DEFAULT)).trace) for v in ("a", "b", "c")}
    # Then (a): a drain took the deferred work and a probe released it under that live lease
    assert "a drain takes the due work" in traces["a"]
    assert "probe releases the claim" in traces["a"].splitlines()[-1]
    # (b): two transient failures were released, not deferred, and one death spent the last
    assert traces["b"].count("transient") == 2
    assert "deferred" not in traces["b"]
    assert f"delivery {MAX_DELIVERIES}" in traces["b"]
    assert "killed" in traces["b"].splitlines()[-1]
    # (c): an operator changes the notes' worker's claim (NULL lease) while the worker runs
    assert "inserts its claim (NULL lease)" in traces["c"]
    assert "operator" in traces["c"].splitlines()[-1]
    assert "node:claimed" in traces["c"].splitlines()[-1]


@pytest.mark.parametrize("variant", ["a", "c"])
def test_work_changed_under_a_live_lease_runs_twice(variant: str) -> None:
    # Given a variant that changes work under a live lease, checked only for the harm
    report = _shown(explore(VARIANTS[variant](DEFAULT), [ONE_LIVE_HOLDER, EXTERNAL_ONCE]))
    # Then the harm follows: two runs hold the work at once, or its effect happens twice
    assert report.violation in (ONE_LIVE_HOLDER, EXTERNAL_ONCE), report.summary()


def test_the_notes_workers_settle_overwrites_a_verdict_given_under_its_lease() -> None:
    # Given (c), with the live-lease rule itself unchecked
    checked = [name for name in INVARIANTS if name != NO_VERB_UNDER_LIVE_LEASE]
    report = _shown(explore(VARIANTS["c"](DEFAULT), checked))
    # Then the worker's own settle, by key alone, overwrites the human's verdict
    assert report.violation == HUMAN_VERDICT_STANDS
    assert "marks done (by key alone)" in report.trace[-1]


def test_the_notes_worker_acks_copies_of_failed_work() -> None:
    # Given the notes' worker beside the drain, and the quiet rule applied strictly to it
    bounds = Bounds(kinds=(EXTERNAL,), steps=10, strict_node=True)
    report = _shown(explore(Protocol(bounds)))
    # Then work can end failed with its message acked by that worker, out of the DLQ: the
    # hazard the default run accepts as settled and the docs name
    assert report.violation == QUIET_MEANS_SETTLED
    assert "the notes' worker finds a row: skip, ack" in "\n".join(report.trace)


def test_the_models_constants_are_the_codes() -> None:
    assert MAX_DELIVERIES == MAX_RECEIVE_COUNT
    assert {RETRY, EXTERNAL} == set(DEFAULT.kinds)


def test_the_command_line_explores_and_prints_a_counterexample(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a small run of the correct model and of variant (c)
    status = main(["--keys", "1", "--kinds", "external", "--steps", "6", "--variant", "c"])
    out = capsys.readouterr().out
    # Then it caught the variant, said so, and printed the trace
    assert status == 0
    assert "VIOLATION no_verb_under_live_lease" in out
    assert "counterexample (3 steps)" in out
    # And an unknown kind is refused
    assert main(["--kinds", "nope"]) == 2

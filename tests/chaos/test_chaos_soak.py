"""The chaos soak at CI size (2,000 jobs); ``make soak`` runs it at 20,000 (``SOAK_JOBS``).

``SOAK_JOBS`` sets the number of jobs, ``SOAK_SEED`` the seed, and ``SOAK_DOCS`` a Markdown file
whose figures section the run rewrites (``make soak`` points it at docs/reliability.md). The run
happens once per module; its table is printed to the terminal.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from soak import (
    DEFERRED_COPY,
    DEFERRED_DONE,
    DEFERRED_FAILED,
    DEFERRED_FOR_A_HUMAN,
    EXPLAINED_DEAD_LETTERS,
    NO_ROW,
    RECONCILED_DONE,
    RECONCILED_NOT_DONE,
    RECONCILED_UNKNOWN,
    WORKLOAD_OUTAGE,
    WORKLOAD_REFUSED,
    ClaimFacts,
    DeferredFacts,
    PlannedJob,
    SoakConfig,
    SoakReport,
    _audited_as_deferred,
    _deferred_facts,
    classify_dead_letter,
    run_soak,
    scan_for_secrets,
    soak_registry,
    write_docs_figures,
)
from soak_jobs import OUTAGE, REFUSED, provider_refuses

from infrai_jobs.jobs.registry import Effect
from infrai_jobs.queue.models import QueueMessage

JOBS = int(os.environ.get("SOAK_JOBS", "2000"))
SEED = int(os.environ.get("SOAK_SEED", "20260726"))
# Both phases must converge within this: about 50 ms per job plus start-up, never below 3 min.
# The CI size takes 1 to 1.5 min on 2 shared cores (the deferred work adds 10-50 s: see
# docs/reliability.md), 20,000 jobs about 5 min.
CONVERGE_SECONDS = max(180.0, JOBS * 0.05 + 60)
SOAK_TIMEOUT = int(CONVERGE_SECONDS + 120)


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SoakReport:
    config = SoakConfig(jobs=JOBS, seed=SEED, timeout_seconds=CONVERGE_SECONDS)
    result = run_soak(config, log_dir=tmp_path_factory.mktemp("soak"))
    # Shown even under output capture: the table is the point of the run.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    assert capture is not None
    with capture.global_and_fixture_disabled():
        print(f"\n\nchaos soak, {JOBS:,} jobs, seed {SEED}\n{result.table()}")
    if os.environ.get("SOAK_DOCS"):
        write_docs_figures(result, Path(os.environ["SOAK_DOCS"]))
    return result


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_every_job_is_done_dead_lettered_with_a_reason_or_flagged(report: SoakReport) -> None:
    # Given N jobs of three effect classes, 30% published twice, a few poison messages,
    # three drain processes fanning out on the backlog, Infrai faults, kills, connection
    # terminations and a restart,
    # run until the queue was empty and the DLQ had been redriven once (the fixture)
    # Then no job is lost, doubled, or left in an unknown state without a flag
    assert report.violations == []
    assert report.outcomes["unexplained (lost, doubled or unflagged)"] == 0
    assert report.outcomes["max e-mails for one key"] <= 1
    assert report.outcomes["max database effects for one key"] == 1
    # And the faults really happened (a soak that injected nothing proves nothing)
    faults = report.faults
    assert faults["Infrai 5xx on consume/ack"] > 0
    assert faults["Infrai 429 on consume/ack (Retry-After: 0)"] > 0
    assert faults["Infrai responses dropped after the call applied"] > 0
    assert faults["drain processes SIGKILLed by the soak"] > 0
    assert faults["drain processes SIGKILLed just before an ack"] > 0
    assert faults["drain connections terminated (pg_terminate_backend)"] > 0
    assert faults["PostgreSQL crash-restarts"] == 1
    assert faults["emulator clock advances (past the visibility timeout)"] >= 3
    assert faults["drains started by backlog fan-out"] > 0


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_messages_the_drains_cannot_read_walk_to_the_dlq_alone(report: SoakReport) -> None:
    # Given a few messages larger than the largest answer the drains read, published among the
    # last publishes of the run above
    config = report.config
    # Then each is in the DLQ unread (no ledger row, no effect), and no neighbour of theirs was
    # lost (test_every_job_is_done_dead_lettered_with_a_reason_or_flagged checks every key)
    assert (
        report.poison["oversized messages in the DLQ, never read by a drain (no ledger row)"]
        == config.oversized_messages
    )
    # And the drains saw their unreadable answers and received at least one of them alone
    poison = report.poison
    assert (
        poison["unreadable answer of a batch consume: its queue's one-at-a-time window opened"]
        + poison["unreadable answer of a consume of one: the message isolated (ERROR logged)"]
        > 0
    )
    assert poison["unreadable answer of a consume of one: the message isolated (ERROR logged)"] > 0
    # And the run's batches stayed batches: one-at-a-time consumes are the exception
    assert poison["share received in batches (%)"] >= 50


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_a_redrive_behind_a_dead_owner_takes_over_or_flags_never_acks(report: SoakReport) -> None:
    # Given digest.build and receipt.send jobs whose drain (600 s lease grace, 3,600 s budget)
    # died inside their calls until their messages were dead-lettered, then redriven
    leased = report.leased
    assert sum(v for k, v in leased.items() if k.startswith("drains killed inside a")) > 0
    # Then, when the operator redrove them, no claim's lease outlived its message
    assert leased["running claims with a live lease when the DLQ was redriven"] == 0
    longest = (
        f"longest lease of a long-grace claim (visibility {report.config.visibility_seconds} s)"
    )
    assert 0 < report.seconds[longest] <= report.config.visibility_seconds
    # And every copy was taken over (digest.build) or flagged stuck (receipt.send), none acked
    # in flight behind the dead owner (the audit checks each key: violations are empty above)
    assert leased["copies acked in flight behind a dead owner"] == 0
    assert leased["digest.build done by the redriven copy's takeover, one digest"] > 0
    # A kill also spends a delivery of the batch's other messages, so in some runs no receipt's
    # claim is taken before its message is dead-lettered (the redriven copy then sends it once,
    # which the audit checks); whenever one was killed inside its call, it is flagged.
    receipts_killed = sum(
        v for k, v in leased.items() if k.startswith("drains killed inside a receipt.send call")
    )
    # (flagged at the redrive: still stuck, or reconciled by its probe at the end)
    flagged = sum(v for k, v in leased.items() if k.startswith("receipt.send flagged stuck"))
    assert flagged > 0 or receipts_killed == 0
    assert report.violations == []


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_deferred_jobs_end_done_once_failed_in_the_ledger_or_left_for_a_human(
    report: SoakReport,
) -> None:
    # Given drains with flow control (JOB_POLICIES: digest.build retries six times and runs one
    # job per tenant at a time, receipt.send has a rate limit), and digests the provider
    # refuses for their first three attempts or always, under the run's faults and kills
    outage = report.workload[WORKLOAD_OUTAGE]
    refused = report.workload[WORKLOAD_REFUSED]
    assert outage > 0
    assert refused > 0
    # Then the ledger deferred work, and ran it from the ledger
    deferred = report.deferred
    assert deferred["deferred rows (keys the ledger deferred)"] >= outage + refused
    assert deferred["drain summaries: deferred runs taken from the ledger"] > 0
    # And every digest the provider refused three times was done once by a deferred run (the
    # audit checks each key: done with exactly one digest, its claim settled done)
    outcomes = report.outcomes
    assert outcomes[f"external_idempotent {DEFERRED_DONE}"] >= outage
    # And every digest it always refused failed for good with its reason in the ledger's
    # dead letters, and no other key did
    assert outcomes[f"external_idempotent {DEFERRED_FAILED}"] == refused
    assert outcomes[f"external {DEFERRED_FAILED}"] == 0
    assert deferred["dead letters held by the ledger (dlq (ledger), unresolved)"] == refused
    # And nothing deferred was left waiting, or running where a drain could take it: the rest
    # are receipts whose deferred run's drain was killed, left running for a human
    assert deferred["  deferred, never run (the audit's violations say why)"] == 0
    left = sum(v for k, v in outcomes.items() if DEFERRED_FOR_A_HUMAN in k)
    assert left == deferred["  running, lease ran out (an external job's: left for a human)"]
    # And no effect ran twice, nothing was lost (the audit's violations cover every key)
    assert outcomes["max e-mails for one key"] <= 1
    assert report.violations == []


def test_the_provider_refuses_an_outage_s_first_three_attempts_and_a_refused_job_always() -> None:
    # Given the payloads the soak plans for digests the provider refuses
    outage = {"job": "digest.build", "soak_refuse": OUTAGE}
    refused = {"job": "digest.build", "soak_refuse": REFUSED}
    # Then the outage refuses the three deliveries (so the third defers it) and nothing after
    assert [provider_refuses(outage, attempt) for attempt in (1, 2, 3, 4)] == [
        True,
        True,
        True,
        False,
    ]
    # And the refused job is refused at every attempt, an ordinary one at none
    assert all(provider_refuses(refused, attempt) for attempt in range(1, 10))
    assert not provider_refuses({"job": "digest.build"}, 1)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_stuck_claims_are_reconciled_before_the_audit(report: SoakReport) -> None:
    # Given the reconcile pass the soak runs once everything converged
    reconciled = report.reconciled
    answers = (RECONCILED_DONE, RECONCILED_NOT_DONE, RECONCILED_UNKNOWN)
    answered = sum(reconciled[answer] for answer in answers)
    # Then every stuck claim it probed got one of the three answers and its action
    assert reconciled["stuck claims probed"] == answered
    assert len(report.answers) == answered
    # And the keys still flagged stuck are exactly those whose probe answered unknown (the
    # audit reports any other as a violation)
    main = sum(v for k, v in report.outcomes.items() if "keys flagged stuck, effect" in k)
    leased = sum(
        v for k, v in report.leased.items() if k.startswith("receipt.send flagged stuck, e-mail")
    )
    still_flagged = main + leased
    assert still_flagged == reconciled[RECONCILED_UNKNOWN]
    assert report.violations == []


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(SOAK_TIMEOUT)
def test_no_secret_reaches_any_output_of_the_run(report: SoakReport) -> None:
    # Given everything the run wrote: every drain process's stdout (Powertools JSON logs, EMF
    # metrics) and stderr (failed invocations' tracebacks), the emulator's and the sink's
    # stderr, and the soak's own infrai_jobs log lines with every extra field
    # Then it was a lot, and neither the API key nor the database password is anywhere in it
    assert report.scanned_files >= 10
    assert report.scanned_bytes > 100_000
    assert report.secret_leaks == []


def test_the_secret_scan_finds_a_planted_secret(tmp_path: Path) -> None:
    # Given a run directory where one log line carries a secret
    (tmp_path / "drain-0001.out").write_text('{"action": "done"}\n')
    (tmp_path / "drain-0002.err").write_text("[ERROR] connect to postgresql://u:hunter2-xyz@db\n")
    # When it is scanned
    leaks, files, size = scan_for_secrets(tmp_path, ["hunter2-xyz", "sk_not_there"])
    # Then the leak is found, named by file, and only that one
    assert leaks == ["secret #0 appears in drain-0002.err"]
    assert files == 2
    assert size > 0


def _refused_digest(mode: str) -> PlannedJob:
    payload = {"job": "digest.build", "tenant_id": "t1", "period": "p1", "soak_refuse": mode}
    return PlannedJob(1, Effect.EXTERNAL_IDEMPOTENT, payload, "digest.build:t1:p1", mode)


def _receipt() -> PlannedJob:
    payload = {"job": "receipt.send", "invoice_id": "inv_1", "email": "a@example.com"}
    return PlannedJob(2, Effect.EXTERNAL, payload, "receipt.send:inv_1", "ok")


def _audit_one(
    job: PlannedJob,
    held: DeferredFacts | None,
    claim: str | None,
    *,
    performed: int,
    reason: str | None = None,
) -> tuple[Counter[str], list[str]]:
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    row = ClaimFacts(claim, None, job.effect.value, False) if claim else None
    handled = _audited_as_deferred(
        job,
        row,
        held,
        performed=performed,
        ledger_reason=reason,
        outcomes=outcomes,
        violations=violations,
    )
    assert handled
    return outcomes, violations


def test_the_audit_counts_each_deferred_end_and_reports_anything_else() -> None:
    outage, refused, receipt = _refused_digest(OUTAGE), _refused_digest(REFUSED), _receipt()
    idempotent, external = Effect.EXTERNAL_IDEMPOTENT.value, Effect.EXTERNAL.value
    # A deferred run done once, its claim settled done: counted as done
    outcomes, violations = _audit_one(
        outage, DeferredFacts("done", idempotent, False), "done", performed=1
    )
    assert outcomes == Counter({f"external_idempotent {DEFERRED_DONE}": 1})
    assert violations == []
    # Failed for good with its reason held by the ledger, nothing built: counted as failed
    outcomes, violations = _audit_one(
        refused,
        DeferredFacts("failed", idempotent, False),
        "failed",
        performed=0,
        reason="deferred job failed after 6 attempt(s): out of attempts",
    )
    assert outcomes == Counter({f"external_idempotent {DEFERRED_FAILED}": 1})
    assert violations == []
    # An external run whose lease ran out: left for a human, and said whether it happened
    outcomes, violations = _audit_one(
        receipt, DeferredFacts("running", external, False), None, performed=1
    )
    assert outcomes == Counter({f"external {DEFERRED_FOR_A_HUMAN}, effect happened": 1})
    assert violations == []
    # Every other end is a violation: done twice, failed without a ledger dead letter (or
    # when the provider would have answered), waiting, a live lease, a refused job never
    # deferred
    bad = [
        _audit_one(outage, DeferredFacts("done", idempotent, False), "done", performed=2),
        _audit_one(refused, DeferredFacts("failed", idempotent, False), "failed", performed=0),
        _audit_one(outage, DeferredFacts("failed", idempotent, False), "failed", performed=0),
        _audit_one(outage, DeferredFacts("deferred", idempotent, False), None, performed=0),
        _audit_one(receipt, DeferredFacts("running", external, True), None, performed=0),
        _audit_one(outage, DeferredFacts("running", idempotent, False), None, performed=0),
        _audit_one(outage, None, "done", performed=1),
    ]
    for outcomes, violations in bad:
        assert outcomes == Counter()
        assert len(violations) >= 1


def test_a_dead_letter_of_deferred_work_is_explained_by_the_ledger() -> None:
    # Given a dead letter whose key has no claim, only deferred work in the ledger
    registry = soak_registry("http://127.0.0.1:9")
    payload = {"job": "digest.build", "tenant_id": "t1", "period": "p1"}
    message = QueueMessage("m1", "soak-jobs-dlq", payload, 3, None, "r1")

    def lookup(key: str) -> ClaimFacts | None:
        return _deferred_facts("running")

    # Then the classifier explains it by the deferred work, and nothing is one NO REASON
    verdict = classify_dead_letter(message, registry, lookup, 65_536)
    assert verdict == DEFERRED_COPY
    assert verdict in EXPLAINED_DEAD_LETTERS
    assert classify_dead_letter(message, registry, lambda key: None, 65_536) == NO_ROW

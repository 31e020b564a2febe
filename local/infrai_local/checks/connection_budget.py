"""Before ``sam build``: the fleet's worst case of database connections fits the ledger's limit.

Every function of the stack may be running at once, each invocation holding what it holds at
most (docs/configuration.md, "The fleet's connection budget"):

    DrainMaxConcurrency x (DrainLanes + 1)   a drain: one per lane, one for its fleet lease
    + the watcher, the outbox relay          2 each (reserved concurrency 1, times 2)
    + redrive, prune                         1 each
    + operators                              3 (the console and two ``infrai-jobs`` commands)

CloudFormation cannot do that arithmetic, so ``make build`` does, with the parameters read as
``sam deploy --config-env ENV`` would take them (samconfig.toml's deploy and global sections over
the template's defaults), and refuses a build whose worst case is above ``DatabaseMaxConnections``
(with ``DatabaseProxy`` create: above the share of it the proxy may open,
``DatabaseProxyMaxConnectionsPercent``), naming every term. ``DatabaseMaxConnections`` 0 (the
default) checks nothing and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infrai_jobs.errors import ConfigurationError
from infrai_local.checks.ca_bundle_check import PREFIX, run_check
from infrai_local.sam_template import deploy_values

# The other functions: connections one invocation holds at most, times its reserved concurrency
# (read from the template). The watcher's alert check and its reconcile pass keep one each; the
# relay may record a dead letter while its batch's transaction is open.
CONNECTIONS_PER_INVOCATION = {
    "DlqAlertFunction": ("the watcher", 2),
    "OutboxRelayFunction": ("the outbox relay", 2),
    "RedriveFunction": ("redrive", 1),
    "PruneFunction": ("prune", 1),
}
# People: the console and two `infrai-jobs` commands at once (each holds one connection).
OPERATORS = 3


@dataclass(frozen=True, slots=True)
class ConnectionBudget:
    """The worst case, term by term, and the limit it is checked against (None: unchecked)."""

    terms: tuple[tuple[str, int], ...]
    limit: int | None
    limit_source: str

    @property
    def worst_case(self) -> int:
        return sum(connections for _, connections in self.terms)

    def described(self) -> str:
        return ", ".join(f"{name} {connections}" for name, connections in self.terms)

    def refusal(self) -> str | None:
        """The line that stops the build, or None when the worst case fits (or is unchecked)."""
        if self.limit is None or self.worst_case <= self.limit:
            return None
        return (
            f"{PREFIX} the fleet's worst case is {self.worst_case} database connections, "
            f"above the {self.limit} {self.limit_source} allows: {self.described()}. Lower "
            "DrainMaxConcurrency or DrainLanes, or raise the database's max_connections (and "
            "DatabaseMaxConnections): `infrai-jobs docs configuration`, 'The fleet's "
            "connection budget'"
        )


def connection_budget(values: Mapping[str, str], resources: Mapping[str, Any]) -> ConnectionBudget:
    """The budget of a stack deployed with parameter ``values`` from the template's
    ``resources``."""
    drains, lanes = _number(values, "DrainMaxConcurrency"), _number(values, "DrainLanes")
    terms = [
        (f"drains DrainMaxConcurrency {drains} x (DrainLanes {lanes} + 1)", drains * (lanes + 1))
    ]
    for function, (name, per_invocation) in CONNECTIONS_PER_INVOCATION.items():
        reserved = (
            resources.get(function, {}).get("Properties", {}).get("ReservedConcurrentExecutions", 1)
        )
        terms.append((name, per_invocation * _resolved(reserved, values)))
    terms.append(("operators and the console", OPERATORS))
    limit = _number(values, "DatabaseMaxConnections")
    if limit <= 0:
        return ConnectionBudget(tuple(terms), None, "")
    source = f"DatabaseMaxConnections={limit}"
    if values.get("DatabaseProxy") == "create":
        percent = _number(values, "DatabaseProxyMaxConnectionsPercent")
        limit, source = (
            limit * percent // 100,
            f"{source} x DatabaseProxyMaxConnectionsPercent={percent}%",
        )
    return ConnectionBudget(tuple(terms), limit, source)


def _resolved(value: Any, values: Mapping[str, str]) -> int:
    if isinstance(value, dict) and "Ref" in value:
        return _number(values, str(value["Ref"]))
    return int(value)


def _number(values: Mapping[str, str], name: str) -> int:
    try:
        return int(values.get(name, "0") or "0")
    except ValueError:
        raise ConfigurationError(f"{name} must be a whole number") from None


def budget_of(root: Path, config_env: str = "default") -> ConnectionBudget:
    """The budget of ``config_env``'s deploy of the stack at ``root``."""
    template, values = deploy_values(root, config_env)
    return connection_budget(values, template.get("Resources", {}))


def main(argv: list[str] | None = None) -> int:
    return run_check(argv, _judged, (__doc__ or "").split("\n", 1)[0])


def _judged(root: Path, config_env: str) -> tuple[str, str]:
    budget = budget_of(root, config_env)
    checked = (
        f"within {budget.limit} ({budget.limit_source})"
        if budget.limit is not None
        else "not checked: set DatabaseMaxConnections"
    )
    passed = f"connection budget: {budget.worst_case} database connections at worst, {checked}"
    return budget.refusal() or "", passed


if __name__ == "__main__":
    sys.exit(main())

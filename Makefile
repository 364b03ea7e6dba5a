# Context Parallelism from Scratch — the commands of the course (a thin front of CMake).
#   make test            set up, build, run every solution test, check skeletons, check the figures
#                        the READMEs quote from docs/ tables (tools/check-quotes), build docs
#                        (the skeleton check ignores your code between the YOUR CODE markers)
#   make setup-cuda-cpu  build CUDA on the CPU (chipStar + PoCL) from source: kernels run without a GPU
#   make demo            the course demo (solutions)
#   make train           lesson 13: a small language model trained on N simulated ranks beside one device (solution)
#   make precision       lesson 13: the bfloat16 ring's error against float64 as the ring grows (solution)
#   make plan            lesson 14: cp_plan, every strategy and mesh predicted for a model on a cluster (solution)
#   make serve           lesson 15: the two prefills at several hit rates, the choice, decode steps (solution)
#   make paged-serving   lesson 19: cache per GPU under TP and DCP, a DCP step's bytes and check, paged decode
#                        beside memcpy (solution; its chart in build/lesson19/)
#   make lesson N=01     build and run the learner tests of one lesson (then under mpirun, once they pass)
#   make status          per-lesson table of the learner's progress
#   make compare N=01    learner vs solution: results, errors, timings, diff of filled regions
#   make sanitize        the solution tests under ASan + UBSan and TSan (build-address/, build-thread/)
#   make test-pip-torch  (maintainers, CI) the course against pip torch 2.11 (the lent GPU machine's):
#                        tools/gpu-check --dry-run, then every test that needs no GPU (build-piptorch/)
#   make gpu-carry       (maintainers) fill .deps/ with what gpu-check needs on a GPU machine without
#                        network: GoogleTest's sources and Open MPI (README, "CUDA and GPUs")
#   make gpu-check       (maintainers, on a GPU) the course on the GPU within a deadline; the report in
#                        docs/gpu-report.md and under $OUT (ARGS="--dry-run --deadline 3000" without one)
#   make test-debian13   (maintainers, CI; root) the course in Debian 13 roots: make demo, make test
#                        and the kernel tests on the CPU there, and every solution built against CUDA
#                        LibTorch + NCCL (build-debian13/); PART=cpu|cuda: one of them; PART=source:
#                        CUDA on the CPU built there from ../shared/cuda-cpu/src, and lesson 03 on it
#   make mutants N=04    (maintainers) apply each classic mistake of tests/mistakes/ to a scratch copy
#                        of the solution: each must fail a test of its lesson, in one screen (N=all)
#   make kernel-stats    (maintainers) per solution kernel and sm_80/sm_90: static PTX counts, registers,
#                        blocks per SM; fails when one breaks a limit of tools/kernel-stats.limits (nvcc)
#   make skeletons       (maintainers) regenerate lessons/ from solutions/; files holding learner
#                        code are first copied to .learner-backups/ (N=01: one lesson)
#   make check-skeletons (maintainers, CI) fail unless lessons/ is exactly what make skeletons writes
SHELL := /bin/bash
BUILD ?= build
CP_CUDA_ARCHS ?= 80;90
CMAKE_PREFIX_PATH ?=
JOBS ?= $(shell nproc)
N ?=
# where tools/status and tools/compare find the test programs
export BUILD_DIR = $(BUILD)

# N as two digits (1 -> 01); empty when N is not a number of one or two digits
NN = $(shell case '$(N)' in ([0-9]|[0-9][0-9]) printf '%02d' $$((10#$(N)));; esac)
LESSONS = $$(ls lessons | tr '\n' ' ')
# CMAKE_FLAGS: more -D options for the configure (CI's CUDA part: -DCP_LEARNER_BUILD=OFF)
CMAKE_FLAGS ?=
CMAKE_ARGS = -G Ninja -DCP_CUDA_ARCHS="$(CP_CUDA_ARCHS)" $(if $(CMAKE_PREFIX_PATH),-DCMAKE_PREFIX_PATH="$(CMAKE_PREFIX_PATH)") $(CMAKE_FLAGS)

.PHONY: setup setup-cuda-cpu configure build test demo train precision plan serve paged-serving lesson status compare docs bench mutants skeletons check-skeletons gpu-check gpu-carry kernel-stats sanitize test-debian13 test-pip-torch clean need-N

setup:
	@tools/setup

# SRC=folder of source tarballs (offline), else the pinned commits are cloned; PREFIX=/opt/cuda-cpu
setup-cuda-cpu:
	tools/build-cuda-on-cpu $(if $(SRC),--src $(SRC)) $(if $(PREFIX),--prefix $(PREFIX))

# --quiet: silent when everything is installed (make test and make demo have run make setup)
$(BUILD)/build.ninja:
	@tools/setup --quiet
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

configure:
	@tools/setup --quiet
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

build: $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: setup build
	rm -f $(BUILD)/kernel-results/*.jsonl
	cd $(BUILD) && ctest -L solution --output-on-failure -j $(JOBS)
	tools/kernel-report
	tools/skeleton --check --lenient
	tools/check-quotes
	cmake --build $(BUILD) --target docs

demo: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target course_demo
	$(BUILD)/bin/course_demo --world 4 --out $(BUILD)/demo
	@echo
	@echo "Lessons you have solved (make status for details): $$(tools/status --solved | sed 's/^$$/none yet/')"

# Lesson 13's two runs (the solution's code; build/bin/lesson13_demo_learner runs yours): the
# loss curves and the precision table, with their charts in build/lesson13/.
train: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson13_demo_solution
	$(BUILD)/bin/lesson13_demo_solution --run train --out $(BUILD)/lesson13

precision: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson13_demo_solution
	$(BUILD)/bin/lesson13_demo_solution --run precision --out $(BUILD)/lesson13

# Lesson 14's planner (the solution's; build/bin/lesson14_demo_learner runs yours): the default
# preset's comparison, the published table beside the predictions, the charts in build/lesson14/.
plan: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson14_demo_solution
	$(BUILD)/bin/cp_plan --out $(BUILD)/lesson14 $(ARGS)

serve: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson15_demo_solution
	$(BUILD)/bin/lesson15_demo_solution $(ARGS)

paged-serving: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson19_demo_solution
	$(BUILD)/bin/lesson19_demo_solution --out $(BUILD)/lesson19 $(ARGS)

need-N:
	@[ -n "$(NN)" ] && ls -d lessons/$(NN)_* >/dev/null 2>&1 || { \
	  if [ -z "$(N)" ]; then echo "usage: make $(firstword $(MAKECMDGOALS)) N=01"; \
	  else echo "make $(firstword $(MAKECMDGOALS)): there is no lesson N=$(N)"; fi; \
	  echo "lessons: $(LESSONS)"; exit 2; }

# The learner tests on local worlds (threads); once every one of them passes, the same tests under
# mpirun too (one process per rank: the CTest entries lessonNN_learner_mpi3 and _mpi4), where the
# lesson has them.
lesson: need-N $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson$(NN)_learner_test
	@set -o pipefail; GTEST_COLOR=$${NO_COLOR:+no} $(BUILD)/bin/lesson$(NN)_learner_test | tee $(BUILD)/lesson$(NN).log; \
	 status=$$?; mpi="cd $(BUILD) && ctest -R '^lesson$(NN)_learner_mpi' --output-on-failure"; \
	 if ! (cd $(BUILD) && ctest -N -R "^lesson$(NN)_learner_mpi" | grep -q 'Total Tests: [1-9]'); then \
	   mpi=""; \
	 elif [ $$status -eq 0 ] && grep -q '^Summary: .* 0 failed, 0 not started' $(BUILD)/lesson$(NN).log; then \
	   echo; echo "Every test passes on local worlds; now under mpirun: $$mpi"; (eval "$$mpi") || status=$$?; mpi=ran; \
	 fi; \
	 echo; \
	 if [ $$status -eq 0 ] && grep -q '^Summary: .* 0 failed, 0 not started' $(BUILD)/lesson$(NN).log; then \
	   echo "Lesson $(NN): every test passes$${mpi:+, on local worlds and under mpirun}."; \
	 else \
	   echo "Lesson $(NN): read lessons/$$(cd lessons && ls -d $(NN)_*)/README.md; write the code between"; \
	   echo "BEGIN YOUR CODE / END YOUR CODE; NOT STARTED tests turn into passes as you go."; \
	   [ -z "$$mpi" ] || [ "$$mpi" = ran ] || echo "Once every test passes, make lesson runs them under mpirun too ($$mpi)."; \
	   echo "A failing test prints its first failure in full, the others one line each: CP_VERBOSE=1 prints all."; \
	 fi; \
	 echo "make compare N=$(NN) shows your code next to the solution; make status shows every lesson."; \
	 exit $$status

# Ninja's "[done/total] ..." lines as one line that rewrites itself on a terminal, else every 10 %.
PROGRESS = awk -v tty=$$([ -t 1 ] && echo 1 || echo 0) '/^\[[0-9]+\/[0-9]+\]/ { \
  split(substr($$1, 2), a, "/"); if (a[1] == 0) next; pct = int(100 * a[1] / a[2]); \
  if (a[2] != total) { total = a[2]; next_pct = 0 } \
  if (tty) { printf "\r\033[K  %s %3d%%  %s", $$1, pct, $$NF; fflush() } \
  else if (pct >= next_pct) { print "  " $$1 " " pct "%"; fflush(); next_pct = pct - pct % 10 + 10 } } \
  END { if (tty) printf "\r\033[K" }'

status: $(BUILD)/build.ninja
	@echo "status: building the learner tests of every lesson (the first build takes several minutes)"
	@set -o pipefail; cmake --build $(BUILD) -j $(JOBS) --target $$(ls lessons | cut -c1-2 | sed 's/.*/lesson&_learner_test/') \
	  2>&1 | tee $(BUILD)/status-build.log | $(PROGRESS) || { \
	  echo "status: the build failed; its errors (all of it: $(BUILD)/status-build.log):"; \
	  grep -m 20 -E 'FAILED:|error' $(BUILD)/status-build.log; \
	  echo "make lesson N=NN builds one lesson and shows its compiler output"; exit 1; }
	@tools/status

compare: need-N $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson$(NN)_learner_test lesson$(NN)_solution_test
	@tools/compare $(NN)

docs: $(BUILD)/build.ninja
	tools/check-quotes
	cmake --build $(BUILD) --target docs
	@echo "open $(BUILD)/docs/html/index.html"

bench: $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target benches
	$(BUILD)/bin/softmax_bench
	$(BUILD)/bin/exchange_bench --world 4
	$(BUILD)/bin/attention_bench

# (maintainers) each classic mistake of tests/mistakes/ must fail a test of its lesson; N=all: every lesson
mutants: $(BUILD)/build.ninja
	tools/mutants $(if $(filter all,$(N)),all,$(or $(NN),$(error make mutants: N=NN (a lesson) or N=all)))

skeletons:
	tools/skeleton --write $(N)

check-skeletons:
	tools/skeleton --check

gpu-check:
	tools/gpu-check $(ARGS)

gpu-carry:
	tools/gpu-carry

test-pip-torch:
	tools/test-pip-torch

# (maintainers) without nvcc it prints that nothing was checked and passes; ARGS=--require fails then.
# ARGS="--arch 90": one architecture; ARGS="--json FILE": the numbers as JSON too.
kernel-stats:
	tools/kernel-stats --check $(ARGS)

sanitize: setup
	tools/sanitize

test-debian13:
	tools/test-debian13 $(if $(PART),--only $(PART))

clean:
	rm -rf $(BUILD) $(BUILD)-address $(BUILD)-thread

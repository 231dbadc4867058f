#!/usr/bin/env bash
# The GPU kit's entry point, copied into the kit as run.sh by scripts/gpu-kit (docs/gpu-kit.md).
#
#   ./run.sh OUT              on a CUDA machine with PyTorch 2.11 (its python3 imports torch)
#   ./run.sh --self-test OUT  on the CPU: the CUDA-only checks say "skipped", the others run small
#
# Finds torch's and the NVIDIA libraries, runs a preflight that stops with a clear line if the
# worker cannot start, then each check with its own time limit, and assembles OUT/report.md,
# OUT/report.json and OUT/report.png after every check, so a run cut short still returns what
# it measured. Everything printed also goes to OUT/kit.log. Nothing is downloaded.
set -uo pipefail

self_test=0
if [ "${1:-}" = "--self-test" ]; then self_test=1; shift; fi
out="${1:?usage: run.sh [--self-test] OUT-FOLDER}"
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/vramgate-kit.XXXXXX")"
exec > >(tee -a "$out/kit.log") 2>&1
started=$(date +%s)
# The whole run's limit: the checks share it; each also has its own.
total="${VRAMGATE_KIT_TOTAL_SECONDS:-470}"
say() { printf 'gpu-kit: %s\n' "$*"; }
note() { printf '%s\n' "$*" >> "$work/notes.md"; }
driver="$kit/bin/vramgate-gpu-kit"

# Every process a check starts, by its path or marker: what a check cut at its limit leaves.
reap() {
  pkill -KILL -f "$kit/bin/ai-worker" 2>/dev/null
  pkill -KILL -f "$work/ai-worker-baseline" 2>/dev/null
  pkill -KILL -f "$kit/bin/raw_loop" 2>/dev/null
  pkill -KILL -f "vramgate-kit-hog" 2>/dev/null
  pkill -KILL -f "nvidia-smi --query-gpu=utilization.gpu,memory.used" 2>/dev/null
  true
}
trap 'reap; rm -rf "$work"' EXIT

report() { "$driver" --kit "$kit" --work "$work" --out "$out" report || say "could not assemble the report (see above)"; }

# --- Preflight: what this machine has -----------------------------------------------------
note "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); kit: $(cat "$kit/VERSION" 2>/dev/null || echo unknown)"
note "- host: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) memory"

device=cpu
python="${VRAMGATE_KIT_PYTHON:-python3}"
if [ "$self_test" -eq 0 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader -i 0 2>/dev/null)"
    say "GPU: $gpu"
    note "- GPU: $gpu (name, memory, driver)"
    note "- $(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -n1)"
    device=cuda
  else
    say "nvidia-smi finds no GPU: run with --self-test on a machine without one"
    note "- nvidia-smi finds no GPU"
  fi
  torch_info="$("$python" -c 'import torch, os; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), os.path.dirname(torch.__file__))' 2>"$work/torch.err" | tail -n1)"
  if [ -z "$torch_info" ]; then
    say "$python cannot import torch: $(tail -n 5 "$work/torch.err")"
    say "set VRAMGATE_KIT_PYTHON to the python whose torch is 2.11 (the worker links its libraries)"
    note "- preflight stopped: $python cannot import torch"
    report; exit 1
  fi
  read -r torch_version torch_cuda cuda_ok torch_dir <<<"$torch_info"
  say "torch $torch_version (CUDA $torch_cuda, available: $cuda_ok) at $torch_dir"
  note "- torch $torch_version, CUDA $torch_cuda, torch.cuda.is_available() = $cuda_ok"
  case "$torch_version" in 2.11.*) ;; *) say "warning: the worker was built against torch 2.11, this is $torch_version" ;; esac
  site="$(dirname "$torch_dir")"
  libs="$torch_dir/lib"
  for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libs="$libs:$d"; done
  # nvml-wrapper opens libnvidia-ml.so; a driver mount may have only libnvidia-ml.so.1.
  nvml="$( (ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so/ {print $NF}'; \
    ls /usr/lib/x86_64-linux-gnu/libnvidia-ml.so* /usr/lib64/libnvidia-ml.so* /usr/local/nvidia/lib64/libnvidia-ml.so* \
       /usr/lib/wsl/lib/libnvidia-ml.so* 2>/dev/null) | grep -v stubs | head -n1)"
  if [ -z "$nvml" ]; then
    # A driver mounted somewhere the loader's cache does not list.
    nvml="$(timeout 20 find /usr /opt /run /lib /lib64 /var/lib /host -name 'libnvidia-ml.so.1' -not -path '*/stubs/*' 2>/dev/null | head -n1)"
  fi
  if [ -n "$nvml" ]; then
    mkdir -p "$work/lib"
    ln -sf "$nvml" "$work/lib/libnvidia-ml.so"
    libs="$work/lib:$libs:$(dirname "$nvml")"
    say "NVML: $nvml"
    note "- NVML: $nvml"
  else
    say "warning: no libnvidia-ml found: the worker's budget will not see the card's free memory"
    note "- NVML: not found"
  fi
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ "$cuda_ok" != "True" ]; then device=cpu; fi
else
  # The self-test: the libtorch the kit was built against, from the build machine's venv.
  if [ -n "${VRAMGATE_KIT_TORCH_LIB:-}" ]; then
    export LD_LIBRARY_PATH="$VRAMGATE_KIT_TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  note "- self-test on the CPU: CUDA-only checks are skipped, the others run small"
fi
missing="$(ldd "$kit/bin/ai-worker" 2>&1 | grep 'not found')"
if [ -n "$missing" ]; then
  say "the worker cannot start, libraries missing:"; printf '%s\n' "$missing"
  note "- preflight stopped: libraries missing: $(printf '%s' "$missing" | tr '\n' ' ')"
  report; exit 1
fi
note "- device the checks run on: $device"
# An earlier worker to measure beside this one in P3 (scripts/gpu-kit, VRAMGATE_KIT_BASELINE).
if [ -f "$kit/bin/ai-worker-baseline.xz" ]; then
  if xz -dc "$kit/bin/ai-worker-baseline.xz" > "$work/ai-worker-baseline" 2>/dev/null \
    || "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
      "$kit/bin/ai-worker-baseline.xz" > "$work/ai-worker-baseline"; then
    chmod 755 "$work/ai-worker-baseline"
    export VRAMGATE_KIT_BASELINE_WORKER="$work/ai-worker-baseline"
    note "- baseline worker beside this one in P3: commit $(cat "$kit/BASELINE" 2>/dev/null)"
  else
    note "- the baseline worker could not be unpacked (neither xz nor python's lzma): P3 runs without it"
  fi
fi
[ -n "${VRAMGATE_KIT_CHECKS:-}" ] && note "- checks chosen (VRAMGATE_KIT_CHECKS): $VRAMGATE_KIT_CHECKS"
[ -n "${VRAMGATE_KIT_TORCH_THREADS:-}" ] && note "- the workers' torch_threads (VRAMGATE_KIT_TORCH_THREADS): $VRAMGATE_KIT_TORCH_THREADS"
[ -n "${VRAMGATE_KIT_WORKER_EXTRA:-}" ] && note "- added to every worker's config (VRAMGATE_KIT_WORKER_EXTRA): $(printf '%s' "$VRAMGATE_KIT_WORKER_EXTRA" | tr '\n' ' ')"
say "checks run on: $device; work folder $work; report in $out"

quick=()
[ "$self_test" -eq 1 ] && quick=(--quick)
failed=()
# check NAME LIMIT-SECONDS: runs one check under its limit (or what is left of the total).
check() {
  local name="$1" limit="$2" left
  left=$(( total - ($(date +%s) - started) - 15 ))
  if [ "$left" -lt 20 ]; then
    say "$name: not run, the run's time is spent"; note "- $name: not run, the run's time was spent"
    failed+=("$name")
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  say "$name: running (limit ${limit} s)"
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$driver" --kit "$kit" --work "$work" --out "$out" --device "$device" \
    --python "$python" --seconds "$((limit - 8))" "${quick[@]}" "$name"
  local rc=$?
  reap
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "$name: cut at its limit of ${limit} s"; note "- $name: cut at its limit of ${limit} s"; failed+=("$name")
  elif [ "$rc" -ne 0 ]; then
    failed+=("$name")
  fi
  say "$name: done in $(( $(date +%s) - t0 )) s (exit $rc)"
  report
}

# The worker warms every batch bucket of every model before it is ready: on a card each new
# shape's first call costs up to a second or more, so its start-up gets more time than a run.
check preflight 150
if ! grep -q '"status": "ok"' "$work/checks/preflight.json" 2>/dev/null; then
  say "preflight failed: the worker cannot start or answer on $device; the report says why ($out/report.md)"
  exit 1
fi
# VRAMGATE_KIT_CHECKS picks the checks after the preflight (all by default), e.g. "p3 oom".
declare -A limit=([budget]=40 [p1]=130 [p3]=150 [oom]=45 [batching]=60 [cards]=80)
# P3 saturates the baseline worker too when the kit carries one.
[ -n "${VRAMGATE_KIT_BASELINE_WORKER:-}" ] && limit[p3]=240
for name in ${VRAMGATE_KIT_CHECKS:-budget p1 p3 oom batching cards}; do
  if [ -z "${limit[$name]:-}" ]; then
    say "no check named $name (the checks: ${!limit[*]})"; failed+=("$name"); continue
  fi
  check "$name" "${limit[$name]}"
done
say "finished in $(( $(date +%s) - started )) s; report: $out/report.md"
if [ "${#failed[@]}" -gt 0 ]; then
  say "checks that failed or were cut: ${failed[*]}"
  exit 1
fi

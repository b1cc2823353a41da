#!/bin/bash
# The measurement campaign of comparisons/results/engine_cpu_overhead_2026-12-07.md: the modes of
# engine_cpu_overhead.py on two checkouts, alternated (BASE_TREE: a checkout of the commit before
# the change, e.g. `git worktree add --detach /tmp/base <commit>`; this checkout is "after"):
#   comparisons/engine_cpu_overhead_campaign.sh BASE_TREE OUT_DIR     (about 45 min on 2 cores)
#   python comparisons/engine_cpu_overhead.py summary --out OUT_DIR
# PARTS (default "main rounds extra") and ROUNDS (default "1 2 3 4 5") pick what runs; the
# report ran PARTS="main rounds", then PARTS=extra, then PARTS=rounds ROUNDS="6 7 8".
set -u
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
S=comparisons/engine_cpu_overhead.py
B=${1:?usage: engine_cpu_overhead_campaign.sh BASE_TREE OUT_DIR}
O=${2:?usage: engine_cpu_overhead_campaign.sh BASE_TREE OUT_DIR}
run() { # tag pythonpath args...
  local tag=$1 pp=$2; shift 2
  echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) start $tag" >> $O/log
  if [ -n "$pp" ]; then PYTHONPATH=$pp python $S "$@" > $O/$tag.out 2>&1; else python $S "$@" > $O/$tag.out 2>&1; fi
  echo "$(date +%T) rc $? end $tag" >> $O/log
}
# before and after alternated, each pair in the other order than the last
pair() { # r tag-before-args... (the same arguments for both trees; --out gets before-r / after-r)
  local r=$1 kind=$2; shift 2
  if [ $((r % 2)) = 1 ]; then
    run $kind-before-$r $B $kind --out $O/$kind/before-$r "$@"; run $kind-after-$r "" $kind --out $O/$kind/after-$r "$@"
  else
    run $kind-after-$r "" $kind --out $O/$kind/after-$r "$@"; run $kind-before-$r $B $kind --out $O/$kind/before-$r "$@"
  fi
}
main() {
  for r in 1 2 3; do pair $r sections --steps 12; done
  for r in 1 2; do pair $r paired --steps 16; done
  run paired-after-zero "" paired --out $O/paired/after-zero --steps 16 --receivers zero
  for s in ddp amsp-plan; do
    run profile-before-$s $B profile --out $O/profile/before --system $s --steps 4
    run profile-after-$s "" profile --out $O/profile/after --system $s --steps 4
  done
}
rounds() { # the harness's 4-rank job; each tree starts with the other row than last round
  for r in ${ROUNDS:-1 2 3 4 5}; do
    local fb=$(( r % 2 )) fa=$(( (r + 1) % 2 ))
    if [ $((r % 2)) = 1 ]; then
      run rounds-before-$r $B rounds --out $O/rounds/before-$r --rounds 1 --first $fb
      run rounds-after-$r "" rounds --out $O/rounds/after-$r --rounds 1 --first $fa
    else
      run rounds-after-$r "" rounds --out $O/rounds/after-$r --rounds 1 --first $fa
      run rounds-before-$r $B rounds --out $O/rounds/before-$r --rounds 1 --first $fb
    fi
  done
}
extra() { # the cuts switched between steps; the glibc heap as it is or with fixed thresholds
  run toggle-1 "" toggle --out $O/toggle/run-1 --steps 20
  for r in 1 2 3; do
    for v in default fixed; do
      [ $((r % 2)) = 0 ] && { [ $v = default ] && v=fixed || v=default; }
      if [ $v = fixed ]; then
        MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296 run heap-$v-$r "" paired --out $O/malloc/$v-$r --steps 12
      else
        run heap-$v-$r "" paired --out $O/malloc/$v-$r --steps 12
      fi
    done
  done
  run toggle-2 "" toggle --out $O/toggle/run-2 --steps 20
  run receivers-1 "" receivers --out $O/receivers/run-1 --steps 16
}
mkdir -p $O
for part in ${PARTS:-main rounds extra}; do $part; done
echo done >> $O/log

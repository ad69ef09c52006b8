#!/bin/bash
# Alternate the W64 bench between a worktree of the base commit at /tmp/base and this working tree;
# 3 runs each (git worktree add /tmp/base <commit> first).
cd "$(dirname "$0")/../.."
out=/tmp/ab_results.txt
: > $out
for i in 1 2 3; do
  for which in base new; do
    if [ $which = base ]; then
      ln -sfn /tmp/base/workbench .dev/workbench; ln -sfn /tmp/base/kernels .dev/workbench_kernels
    else
      ln -sfn ../workbench .dev/workbench; ln -sfn ../kernels .dev/workbench_kernels
    fi
    r=$(WORKBENCH_RUNS_DB=off timeout 900 .venv/bin/workbench bench --systems workbench --json --no-single-stream 2>/dev/null | python -c "import json,sys; d=json.load(sys.stdin); print(round(d['results']['workbench']['output_tok_s'],1))")
    echo "$which $r" | tee -a $out
  done
done
ln -sfn ../workbench .dev/workbench; ln -sfn ../kernels .dev/workbench_kernels

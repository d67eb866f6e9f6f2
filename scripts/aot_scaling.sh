#!/bin/bash
# The compiles behind docs/pods.md and docs/notes/scaling-log.md (each 142M+ compile takes minutes of CPU; they queue on
# a lock so that they never run two at a time). JSON reports land in docs/aot/.
#   bash scripts/aot_scaling.sh [row ...]       rows: see the case below; default: all, in order
set -u
cd "$(dirname "$0")/.."
mkdir -p docs/aot
FSDP="--config.mesh.data=1 --config.mesh.fsdp=-1 --config.mesh.tensor=1"
aot() {  # name, args...
  local name=$1; shift
  echo "== $name: python -m onona_jax.aot $*" >&2
  flock /tmp/onona-heavy.lock python -m onona_jax.aot "$@" --json_out=docs/aot/$name.json \
    > docs/aot/$name.txt 2> >(grep -v -e '^WARNING' -e '^E0000' -e 'Source Location' -e 'learning/' -e 'host bounds' >&2)
  echo "   exit $?" >&2
}
rows=${*:-dense-142m dense-142m-standard moe-142m gdn-142m attnres-142m dense-330m moe-330m gdn-330m attnres-330m dense-1b moe-1b gdn-1b attnres-1b}
for row in $rows; do
  case $row in
    dense-142m) aot dense-142m-v5e-16 --config=configs/paper.py:dense-142m-twin --topology=v5e-16 $FSDP --compare_head=standard --fit ;;
    # the same compiles at --fit's choice, without the search (faster to rerun)
    dense-142m-at4) aot dense-142m-at4-v5e-16 --config=configs/paper.py:dense-142m-twin --topology=v5e-16 $FSDP --compare_head=standard --config.train.micro_batch=4 --noeval_step ;;
    # two v5e-16 slices (mesh.slices=2: fsdp over each slice's 16 chips, data across the 2) at the
    # v5e-16 row's remat (attention); 256 rows over 32 chips: 8 per chip, no accumulation
    dense-142m-2slices) aot dense-142m-2x-v5e-16 --config=configs/paper.py:dense-142m-twin --topology=v5e-16 --slices=2 $FSDP --compare_head=standard --config.train.micro_batch=8 --config.model.remat=attention --noeval_step ;;
    dense-142m-standard) aot dense-142m-standard-v5e-16 --config=configs/paper.py:dense-142m-standard --topology=v5e-16 $FSDP --fit --noeval_step ;;
    moe-142m|gdn-142m|attnres-142m)
      aot ${row}-v5e-16 --config=configs/paper.py:${row}-twin --topology=v5e-16 $FSDP --compare_head=standard \
        --fit --noeval_step ;;
    moe-330m|gdn-330m|attnres-330m)
      aot ${row}-v5p-64 --config=configs/paper.py:${row}-twin --topology=v5p-64 $FSDP --compare_head=standard \
        --fit --config.train.micro_batch=0 --noeval_step ;;
    gdn-1b|attnres-1b)
      aot ${row}-v5p-256 --config=configs/paper.py:${row}-twin --topology=v5p-256 $FSDP --compare_head=standard \
        --fit --config.train.micro_batch=0 --noeval_step ;;
    # 330M: 256 rows over 32 replicas (8 each); 1B: 512 over 128 (4 each): the paper's micro-batches
    # 16 and 8 exceed a replica's rows there, so --fit starts from the whole replica batch.
    dense-330m) aot dense-330m-v5p-64 --config=configs/paper.py:dense-330m-twin --topology=v5p-64 $FSDP --compare_head=standard --fit --config.train.micro_batch=0 --noeval_step ;;
    dense-1b) aot dense-1b-v5p-256 --config=configs/paper.py:dense-1b-twin --topology=v5p-256 $FSDP --compare_head=standard --fit --config.train.micro_batch=0 --noeval_step ;;
    # the v5p-256 row at --fit's choice, without the search (the one-slice side of dense-1b-2slices)
    dense-1b-at4) aot dense-1b-at4-v5p-256 --config=configs/paper.py:dense-1b-twin --topology=v5p-256 $FSDP --compare_head=standard --config.train.micro_batch=4 --config.model.remat=none --noeval_step ;;
    # two v5p-128 slices joined by DCN (mesh.slices=2: fsdp over each slice's 64 chips, data across
    # the 2 slices) at the v5p-256 row's plan (4 × 1, remat none); compare with dense-1b
    dense-1b-2slices) aot dense-1b-2x-v5p-128 --config=configs/paper.py:dense-1b-twin --topology=v5p-128 --slices=2 $FSDP --compare_head=standard --config.train.micro_batch=4 --config.model.remat=none --noeval_step ;;
    # Longer contexts (issue 38, the paper's open question): <spec>@<seq_len> keeps the paper's batch in
    # tokens (4,096: 64 windows a step; 8,192: 32), splash; --fit from the whole per-replica batch.
    dense-142m-ctx4096|dense-142m-ctx8192)
      aot ${row}-v5e-16 --config=configs/paper.py:dense-142m-twin@${row#dense-142m-ctx} --topology=v5e-16 $FSDP \
        --compare_head=standard --config.train.micro_batch=0 --fit --noeval_step ;;
    dense-330m-ctx4096|dense-330m-ctx8192)
      aot ${row}-v5p-64 --config=configs/paper.py:dense-330m-twin@${row#dense-330m-ctx} --topology=v5p-64 $FSDP \
        --compare_head=standard --config.train.micro_batch=0 --fit --noeval_step ;;
    dense-1b-ctx4096) aot ${row}-v5p-256 --config=configs/paper.py:dense-1b-twin@4096 --topology=v5p-256 $FSDP \
        --compare_head=standard --config.train.micro_batch=0 --fit --noeval_step ;;
    # 64 windows of 8,192 over 128 chips: half a window each under pure FSDP, so 2-way tensor parallel
    dense-1b-ctx8192) aot ${row}-v5p-256 --config=configs/paper.py:dense-1b-twin@8192 --topology=v5p-256 \
        --config.mesh.data=1 --config.mesh.fsdp=-1 --config.mesh.tensor=2 --compare_head=standard \
        --config.train.micro_batch=0 --fit --noeval_step ;;
    # MoE dispatch and expert parallelism (issue 26) at the replicated layout's --fit plans, twin only:
    # sort / grouped with experts replicated over the expert axis (fsdp everywhere), and grouped with
    # an 8-way expert axis; dense-142m-at16 / dense-1b-at4 are the Dense rows at the same plans.
    moe-142m-sort|moe-142m-grouped|moe-142m-ep8)
      case $row in *ep8) mesh="--config.mesh.fsdp=2 --config.mesh.expert=8" d=grouped ;; *) mesh="--config.mesh.fsdp=16" d=${row#moe-142m-} ;; esac
      aot ${row}-v5e-16 --config=configs/paper.py:moe-142m-twin --topology=v5e-16 --config.mesh.data=1 $mesh \
        --config.model.moe.dispatch=$d --config.train.micro_batch=16 --config.model.remat=attention --noeval_step ;;
    # grouped, experts replicated, the expert gather kept for the backward pass (remat=attention_experts)
    moe-142m-grouped-keep) aot moe-142m-grouped-keep-v5e-16 --config=configs/paper.py:moe-142m-twin --topology=v5e-16 \
      --config.mesh.data=1 --config.mesh.fsdp=16 --config.model.moe.dispatch=grouped --config.train.micro_batch=16 \
      --config.model.remat=attention_experts --noeval_step ;;
    moe-1b-sort|moe-1b-grouped|moe-1b-ep8)
      case $row in *ep8) mesh="--config.mesh.fsdp=16 --config.mesh.expert=8" d=grouped ;; *) mesh="--config.mesh.fsdp=128" d=${row#moe-1b-} ;; esac
      aot ${row}-v5p-256 --config=configs/paper.py:moe-1b-twin --topology=v5p-256 --config.mesh.data=1 $mesh \
        --config.model.moe.dispatch=$d --config.train.micro_batch=4 --config.model.remat=none --noeval_step ;;
    dense-142m-at16) aot dense-142m-at16-v5e-16 --config=configs/paper.py:dense-142m-twin --topology=v5e-16 $FSDP --config.train.micro_batch=16 --config.model.remat=attention --noeval_step ;;
    moe-1b) aot moe-1b-v5p-256 --config=configs/paper.py:moe-1b-twin --topology=v5p-256 $FSDP --compare_head=standard --fit --config.train.micro_batch=0 --noeval_step ;;
    # one 8-GPU H100 host, docs/pods.md's recipe (pure data parallel, micro-batch 16 × 2); needs the gpu-aot extra
    # (gpu-aot extra with the cuDNN wheel: auto = cuDNN's fused attention; -xla: XLA's, for comparison)
    dense-142m-h100) aot dense-142m-h100-8 --config=configs/paper.py:dense-142m-twin --topology=h100-8 --config.mesh.data=8 --config.train.micro_batch=16 --compare_head=standard --noeval_step ;;
    dense-142m-h100-xla) aot dense-142m-h100-8-xla --config=configs/paper.py:dense-142m-twin --topology=h100-8 --config.mesh.data=8 --config.train.micro_batch=16 --config.model.attention_impl=xla --compare_head=standard --noeval_step ;;
    # Past the paper (docs/notes/scaling-log.md "Sizes past the paper"): 3b and 8b at GPT-2's vocabulary (row dense-8b)
    # and Llama-3's (row dense-8b-v128256: data.tokenizer=size:128256). --fit ran on the Dense GPT-2 rows;
    # the Dense 128,256 rows compile at its plan; MoE does not fit there (147.6 / 134.0 GiB asked at
    # 128,256) and compiles with remat=attention at the whole per-chip batch (8b) / the Dense micro-batch (3b).
    dense-8b|dense-3b) aot ${row}-v5p-256 --config=configs/paper.py:${row}-twin --topology=v5p-256 $FSDP --compare_head=standard --fit --noeval_step ;;
    dense-8b-v128256|moe-8b|moe-8b-v128256|dense-3b-v128256|moe-3b|moe-3b-v128256)
      tok=gpt2; case $row in *-v128256) tok=size:128256 ;; esac
      spec=${row%-v128256}
      case $spec in
        dense-8b) plan="--config.train.micro_batch=2 --config.model.remat=none" ;;
        moe-8b) plan="--config.train.micro_batch=8 --config.model.remat=attention" ;;
        dense-3b) plan="--config.train.micro_batch=4 --config.model.remat=none" ;;
        moe-3b) plan="--config.train.micro_batch=4 --config.model.remat=attention" ;;
      esac
      aot ${row}-v5p-256 --config=configs/paper.py:${spec}-twin --config.data.tokenizer=$tok --topology=v5p-256 $FSDP \
        --compare_head=standard $plan --noeval_step ;;
    # one 8-GPU host, fsdp over its 8 GPUs, at a plan chosen from the TPU figures (not --fit: its search is 15 compiles here)
    dense-8b-h100|dense-8b-v128256-h100|dense-8b-h200|dense-8b-v128256-h200)
      gpu=${row##*-}; spec=${row%-*}; tok=gpt2; case $spec in *-v128256) tok=size:128256 ;; esac
      aot ${spec}-${gpu}-8 --config=configs/paper.py:${spec%-v128256}-twin --config.data.tokenizer=$tok --topology=${gpu}-8 $FSDP \
        --compare_head=standard --config.train.micro_batch=8 --config.model.remat=attention --noeval_step ;;
    # --fit on one H100 host (dense-8b-twin at 50,304: it chose remat=dots, 4 × 32), and the 128,256 row at that plan
    dense-8b-h100-fit) aot dense-8b-h100-8-fit --config=configs/paper.py:dense-8b-twin --topology=h100-8 $FSDP --compare_head=standard --fit --noeval_step ;;
    dense-8b-v128256-h100-dots) aot dense-8b-v128256-h100-8-dots --config=configs/paper.py:dense-8b-twin --config.data.tokenizer=size:128256 \
      --topology=h100-8 $FSDP --compare_head=standard --config.train.micro_batch=4 --config.model.remat=dots --noeval_step ;;
    *) echo "unknown row $row" >&2 ;;
  esac
done

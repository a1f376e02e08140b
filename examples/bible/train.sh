#!/usr/bin/env bash
# Train one bundled model on CPU.
#   usage: bash examples/bible/train.sh TASK DATA_BIN SAVE_DIR [MINUTES]
#   TASK: es-en   (post-LN transformer, Reina-Valera -> KJV)
#         kjv-web (pre-LN transformer, KJV -> WEB)
# Both: 3+3 layers, 256/1024, 4 heads, all embeddings shared; 1 torch thread so two can train
# side by side on a 2-core machine.  Stops after MINUTES (default 40) of wall time.
set -euo pipefail
task=${1:?task}; data=${2:?data-bin}; save=${3:?save dir}; minutes=${4:-40}
case "$task" in
  es-en)   langs=(--source-lang es --target-lang en); norm=() ;;
  kjv-web) langs=(--source-lang kjv --target-lang web)
           norm=(--encoder-normalize-before --decoder-normalize-before) ;;
  *) echo "unknown task $task" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# stock fairseq-train on torch >= 2.6 cannot resume its own checkpoint_last.pt otherwise
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
fairseq-train "$data" "${langs[@]}" "${norm[@]}" \
  --arch transformer --share-all-embeddings \
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 \
  --encoder-attention-heads 4 --decoder-attention-heads 4 \
  --dropout 0.1 --attention-dropout 0.0 --activation-dropout 0.0 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
  --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 400 --warmup-init-lr 1e-07 \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-tokens 3000 --max-source-positions 256 --max-target-positions 256 \
  --stop-time-hours "$(python -c "print($minutes/60)")" --max-epoch 100 \
  --save-dir "$save" --no-epoch-checkpoints --save-interval-updates 500 --keep-interval-updates 1 \
  --num-workers 0 --seed 1 --log-format simple --log-interval 100 --cpu

#!/usr/bin/env bash
# Train a small draft model for aggressive decoding of the bundled es->en model
# (`--fastgen-aggressive on --fastgen-draft-model DRAFT.pt`): same data and joint dictionary
# as examples/bible (so the same target dictionary), 1 encoder + 1 decoder layer, dim 256.
#   usage: bash examples/draft_model/train.sh DATA_BIN SAVE_DIR [MINUTES]
#   DATA_BIN: examples/bible's binarized es-en data (examples/bible/prepare.sh makes it)
set -euo pipefail
data=${1:?data-bin}; save=${2:?save dir}; minutes=${3:-15}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
fairseq-train "$data" --source-lang es --target-lang en \
  --arch transformer --share-all-embeddings \
  --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 256 --decoder-embed-dim 256 \
  --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 \
  --encoder-attention-heads 4 --decoder-attention-heads 4 \
  --dropout 0.1 --attention-dropout 0.0 --activation-dropout 0.0 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
  --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 200 --warmup-init-lr 1e-07 \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-tokens 4000 --max-source-positions 256 --max-target-positions 256 \
  --stop-time-hours "$(python -c "print($minutes/60)")" --max-epoch 100 \
  --save-dir "$save" --no-epoch-checkpoints --save-interval-updates 200 --keep-interval-updates 1 \
  --no-last-checkpoints --num-workers 0 --seed 1 --log-format simple --log-interval 50 --cpu

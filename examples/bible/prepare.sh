#!/usr/bin/env bash
# Build the bundled Bible data: verse-aligned corpora -> joint SentencePiece -> fairseq binaries.
#   needs: apt-get install sword-text-kjv sword-text-web sword-text-sparv diatheke
#   usage: bash examples/bible/prepare.sh WORKDIR   (writes WORKDIR/{raw,spm,data-bin})
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:?usage: prepare.sh WORKDIR}
vocab=${VOCAB:-6000}
mkdir -p "$work"/{raw,spm,data-bin}

python "$here/build_corpus.py" --out "$work/raw"

# One joint SentencePiece model over all three Bibles' training verses, so both tasks share
# one dictionary (and shared embeddings are possible).
cat "$work"/raw/es-en.train.es "$work"/raw/kjv-web.train.kjv "$work"/raw/kjv-web.train.web > "$work/spm/train.txt"
python - "$work/spm" "$vocab" <<'PY'
import sys, sentencepiece as spm
out, vocab = sys.argv[1], int(sys.argv[2])
spm.SentencePieceTrainer.train(
    input=f"{out}/train.txt", model_prefix=f"{out}/spm", vocab_size=vocab,
    character_coverage=1.0, model_type="unigram", bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
    minloglevel=2)
# fairseq dictionary: every piece but <unk> (fairseq adds its own specials), count 1.
with open(f"{out}/spm.vocab", encoding="utf-8") as f, open(f"{out}/dict.txt", "w", encoding="utf-8") as d:
    for line in f:
        piece = line.split("\t")[0]
        if piece != "<unk>":
            d.write(f"{piece} 1\n")
PY

encode() {  # encode RAW_IN SPM_OUT
  python -c "import sys,sentencepiece as s; m=s.SentencePieceProcessor(model_file=sys.argv[1]); [print(' '.join(m.encode(l.rstrip('\n'), out_type=str))) for l in open(sys.argv[2], encoding='utf-8')]" \
    "$work/spm/spm.model" "$1" > "$2"
}

for pair in es-en:es:kjv:es:en kjv-web:kjv:web:kjv:web; do
  IFS=: read -r task rsrc rtgt src tgt <<< "$pair"
  mkdir -p "$work/spm/$task"
  for split in train valid test; do
    encode "$work/raw/$task.$split.$rsrc" "$work/spm/$task/$split.$src"
    encode "$work/raw/$task.$split.$rtgt" "$work/spm/$task/$split.$tgt"
  done
  fairseq-preprocess --source-lang "$src" --target-lang "$tgt" \
    --trainpref "$work/spm/$task/train" --validpref "$work/spm/$task/valid" --testpref "$work/spm/$task/test" \
    --srcdict "$work/spm/dict.txt" --tgtdict "$work/spm/dict.txt" \
    --destdir "$work/data-bin/$task" --workers 2
done

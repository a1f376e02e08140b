"""Scores of a hypothesis text under the stock model: the proof that two differing
hypotheses are a near-tie (:mod:`fairseq_fastgen.compare`)."""
from typing import Sequence, Tuple


def model_rescorer(data: str, path: str, extra: Sequence[str] = ()):
    """A rescore callable: sentence score of a hypothesis text under the stock model.

    The hypothesis text is the D line (detokenized) or H line; it is encoded back with the
    task's tokenizer/BPE through fairseq's hub interface, then scored as fairseq's
    SequenceScorer does (mean log-probability including EOS).
    """
    import torch
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, [data, "--path", path, *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble(path.split(":"), task=task)
    hub = GeneratorHubInterface(cfg, task, models)
    dataset = task.dataset(cfg.dataset.gen_subset)

    def rescore(sid: int, hyp_a: str, hyp_b: str) -> Tuple[float, float]:
        src = dataset[sid]["source"]
        out = []
        for hyp in (hyp_a, hyp_b):
            tgt = hub.encode(hyp)
            with torch.no_grad():
                scores = []
                for m in hub.models:
                    m.eval()
                    prev = torch.cat([tgt[-1:], tgt[:-1]]).unsqueeze(0)
                    logits, _ = m(src.unsqueeze(0), torch.tensor([src.numel()]), prev)
                    lp = m.get_normalized_probs((logits, None), log_probs=True)[0]
                    scores.append(lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
                pos = torch.stack(scores).mean(0)
            out.append(float(pos.sum() / pos.numel()))
        return out[0], out[1]

    return rescore


def lazy_rescorer(data, path, gen_args):
    """:func:`model_rescorer` for a fairseq-generate command line, built at its first call."""
    cache = {}

    def rescore(sid, a, b):
        if "f" not in cache:
            keep = [x for x in gen_args[1:] if x not in ("--path", path)]
            passthrough = []
            for flag in ("--source-lang", "--target-lang", "--task", "--gen-subset", "--bpe",
                         "--sentencepiece-model", "--tokenizer", "--post-process", "--remove-bpe"):
                if flag in keep:
                    i = keep.index(flag)
                    passthrough += keep[i:i + 2]
            cache["f"] = model_rescorer(data, path, passthrough)
        return cache["f"](sid, a, b)

    return rescore

"""The last step of benchmarks/device_check.sh: OUTDIR/summary.json and OUTDIR/summary.md
from the parts' record and their result files.  Exit status 1 when a part failed, ran out
of time, or left a result file that does not parse; a part skipped because its script is not
in the checkout is not a failure.
"""
import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RESULT = {"pytest": "pytest.xml", "generator": "generator.json", "suite": "suite.json",
          "real_sizes": "real_sizes.json"}
MAX_FILES, MAX_BYTES = 8, 16 * 2**20  # what a device run brings back


def read_parts(path: Path):
    parts = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, rc, secs, cap, why = (line.split("\t") + [""] * 6)[:6]
        parts.append(dict(name=name, status=status, exit=int(rc) if rc else None, seconds=int(secs or 0),
                          timeout_s=int(cap or 0), why=why or None))
    return parts


def pytest_figures(p: Path) -> dict:
    root = ET.parse(p).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    n["skipped_reasons"] = sorted({(e.get("message") or "")[:120] for e in root.iter("skipped")})
    return n


def generator_figures(p: Path) -> dict:
    d = json.loads(p.read_text())
    return dict(cells=len(d["cells"]), failed_cells=d.get("failed_cells"), environment=d.get("environment"))


def suite_figures(p: Path) -> dict:
    d = json.loads(p.read_text())
    cells = d["cells"] if isinstance(d, dict) else d
    lossy = [(c["tag"], n) for c in cells for n, r in c["systems"].items() if r.get("lossless") is False]
    return dict(cells=len(cells), partial=not isinstance(d, dict), not_lossless=lossy)


def real_sizes_figures(p: Path) -> dict:
    d = json.loads(p.read_text())
    return dict(cells=len(d["cells"]), not_lossless=[c.get("name", c.get("cell")) for c in d["cells"]
                                                     if not c.get("lossless")])


FIGURES = {"pytest": pytest_figures, "generator": generator_figures, "suite": suite_figures,
           "real_sizes": real_sizes_figures}


def generator_table(p: Path):
    d = json.loads(p.read_text())
    rows = ["| model | precision | mode | beam | ngram | hyps | token diffs | max score diff | lossless (fp32 rule) "
            "| stock s | fastgen s | ratio |", "|" + "---|" * 12]
    for c in d["cells"]:
        if "error" in c:
            rows.append(f"| {c.get('model')} | {c['precision']} | {c['mode']} | {c.get('beam')} | "
                        f"{c.get('no_repeat_ngram_size', 0)} | error: {c['error'][:80]} |||||||")
            continue
        rows.append(f"| {c['model']} | {c['precision']} | {c['mode']} | {c['beam']} | {c.get('no_repeat_ngram_size', 0)} "
                    f"| {c['hyps']} | {c['token_diffs']} | {c['max_score_diff']:.2e} | {c['lossless']} "
                    f"| {c['stock_s']} | {c['fastgen_s']} | {c['ratio']} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", type=Path, required=True)
    p.add_argument("--install", type=Path, required=True)
    p.add_argument("--outdir", type=Path, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--tiny", default="0")
    p.add_argument("--elapsed", type=int, default=0)
    p.add_argument("--real-sizes-md", default="")
    a = p.parse_args(argv)
    parts = read_parts(a.parts)
    install = json.loads(a.install.read_text()) if a.install.exists() else None
    for part in parts:
        res = RESULT.get(part["name"])
        if res is None or part["status"] == "skipped":
            continue
        f = a.outdir / res
        part["result_file"] = res if f.exists() else None
        if f.exists():
            try:
                part["figures"] = FIGURES[part["name"]](f)
            except Exception as e:  # noqa: BLE001  (recorded: a result that does not parse fails the run)
                part["parse_error"] = f"{type(e).__name__}: {e}"
    failed = [q["name"] for q in parts if q["status"] in ("failed", "timeout") or q.get("parse_error")
              or (q["status"] == "ok" and q["name"] in RESULT and not q.get("result_file"))]
    summary = dict(device=a.device, tiny=a.tiny == "1", elapsed_s=a.elapsed, parts=parts, install=install,
                   failed_parts=failed)
    (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    md = [f"# device_check ({a.device}{', tiny' if a.tiny == '1' else ''}): {a.elapsed} s, "
          f"{'all parts ok' if not failed else 'FAILED: ' + ', '.join(failed)}", ""]
    if install:
        md += [f"python {install.get('python')}, torch {install.get('torch')} (CUDA {install.get('cuda')}, "
               f"available {install.get('cuda_available')}), CuPy {install.get('cupy')}, "
               f"fairseq {install.get('fairseq', '?')}", ""]
        md += [f"- install problem: {x}" for x in install.get("problems", [])]
    md += ["| part | status | exit | seconds | timeout | result |", "|---|---|---|---|---|---|"]
    for q in parts:
        what = q.get("why") or q.get("parse_error") or json.dumps(q.get("figures", ""), default=str)[:300]
        md.append(f"| {q['name']} | {q['status']} | {q['exit'] if q['exit'] is not None else ''} | {q['seconds']} "
                  f"| {q['timeout_s']} | {what} |")
    gen = a.outdir / "generator.json"
    if gen.exists():
        try:
            md += ["", "## generator_check", "", *generator_table(gen)]
        except Exception as e:  # noqa: BLE001
            md += ["", f"generator.json unreadable: {e}"]
    if a.real_sizes_md and Path(a.real_sizes_md).exists():
        md += ["", "## real sizes", "", Path(a.real_sizes_md).read_text()]
    (a.outdir / "summary.md").write_text("\n".join(md) + "\n")

    files = [f for f in a.outdir.iterdir()]
    too_big = [f.name for f in files if f.is_file() and f.stat().st_size > MAX_BYTES]
    if len(files) > MAX_FILES or too_big:
        print(f"summarize: OUTDIR holds {len(files)} entries (max {MAX_FILES}); too big: {too_big}", file=sys.stderr)
        return 1
    print(f"summarize: {len(parts)} parts, failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU benchmark's report (:mod:`benchmarks.bench_gpu`): its targets and its tables, one per part."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from benchmarks import common


def targets(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The issue's targets, from the rows measured (GPU runs only)."""
    if not device.startswith("cuda"):
        return []

    def best(part: str, key: str, pred: Callable[[dict[str, Any]], bool] = lambda r: True) -> float:
        vals = [r[key] for r in rows if r["part"] == part and pred(r) and r.get(key) is not None]
        return max(vals) if vals else 0.0

    out = []
    if any(r["part"] == "hubert" for r in rows):
        low = max(best("hubert", "x_realtime", lambda r, p=p: r["precision"] == p and r["mode"] == "batched")
                  for p in ("bf16", "fp16"))
        f32 = best("hubert", "x_realtime", lambda r: r["precision"] == "float32" and r["mode"] == "batched")
        out += [common.target("HuBERT-base, reduced precision", ">= 10,000x real time per GPU", low, low >= 10_000),
                common.target("HuBERT-base, float32", ">= 3,000x real time per GPU", f32, f32 >= 3_000)]
        rel = best("hubert", "stats_rel_diff", lambda r: r["precision"] == "float32")
        if any(r["mode"] == "collect-stats moments" for r in rows if r["part"] == "hubert"):
            out.append(common.target("HuBERT float32 moments vs the host's", "rel. <= 1e-6", rel, rel <= 1e-6))
    if any(r["part"] == "fbank" for r in rows):
        fb = best("fbank", "x_realtime", lambda r: "gathered" in r["mode"])
        cs = best("fbank", "x_realtime", lambda r: "collect-stats" in r["mode"])
        rel = best("fbank", "stats_rel_diff")
        out += [common.target("fbank (80-dim) on the GPU", ">= 50,000x real time", fb, fb >= 50_000),
                common.target("fbank collect-stats on the GPU, end to end", ">= 50,000x real time", cs, cs >= 50_000),
                common.target("fbank stats vs the CPU run", "rel. <= 1e-5", rel, rel <= 1e-5)]
    for part, goal in (("ecapa", 5_000), ("rawnet3", None)):
        if any(r["part"] == part for r in rows):
            ups = best(part, "utt_per_s")
            cos = min(r["min_cosine_vs_alone"] for r in rows if r["part"] == part and r["precision"] == "float32")
            if goal:
                out.append(common.target(f"{part} x-vectors", f">= {goal:,} utt/s per GPU", ups, ups >= goal))
            out.append(common.target(f"{part}: batched vs alone", "worst cosine >= 0.99999", cos, cos >= 0.99999))
    if any(r["part"] == "local_gpu" for r in rows):
        rel = best("local_gpu", "stats_rel_diff")
        out.append(common.target("local_gpu collect-stats vs the CPU", "rel. <= 1e-5", rel, rel <= 1e-5))
    return out


def sci(value: float | None) -> str:
    """``1.2e-05``, or a dash for nothing measured."""
    return "–" if value is None else f"{value:.1e}"


def audio_hours(rows: list[dict[str, Any]]) -> list[tuple[str, float | None, float | None, str]]:
    """Audio hours per GPU hour of each job's product path (= audio seconds per second), exact
    float32 and fastest: ``(job, exact, fastest, the fastest's precision and batch)``."""
    def speed(r: dict[str, Any]) -> float:
        return r["x_realtime"] if "x_realtime" in r else r["audio_s"] / r["wall_s"]

    def pick(job: str, chosen: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]):
        if not chosen:
            return []
        exact = [speed(r) for r in chosen if r.get("precision", "float32") == "float32"]
        best = max(chosen, key=speed)
        return [(job, max(exact) if exact else None, speed(best), label(best))]

    def of(part: str, mode: str | None = None) -> list[dict[str, Any]]:
        return [r for r in rows if r["part"] == part and (mode is None or r.get("mode") == mode)]

    fbank = [r for r in of("fbank") if r.get("mode", "").startswith(("cuda", "cpu,"))]
    return (pick("collect-stats, fbank", [r for r in fbank if "moments" in r["mode"]], lambda r: "float32")
            + pick("fbank features written", [r for r in fbank if "gathered" in r["mode"]], lambda r: "float32")
            + pick("collect-stats, HuBERT-base", of("hubert", "collect-stats moments"), lambda r: r["precision"])
            + pick("HuBERT-base features written", of("hubert", "batched"),
                   lambda r: f"{r['precision']}, {r['max_batch_samples']:,} samples per batch")
            + pick("HuBERT-base features into a Kaldi ark, extract-features' calls",
                   [r for r in of("hubert") if r["mode"].startswith("written")],
                   lambda r: f"{r['precision']}, {r['mode'].split(', ', 1)[1]}")
            + pick("x-vectors, ECAPA-TDNN", of("ecapa"), lambda r: f"{r['precision']}, batch {r['batch']}")
            + pick("x-vectors, RawNet3", of("rawnet3"), lambda r: f"{r['precision']}, batch {r['batch']}"))


def table(result: dict[str, Any]) -> str:
    """One table per part."""
    rows = result["rows"]
    out = [f"Device: {result.get('device')}"]
    hub = [r for r in rows if r["part"] == "hubert"]
    if hub:
        alone = {r["precision"]: r["x_realtime"] for r in hub if r["mode"].startswith("model only")}

        def host_share(r: dict[str, Any]) -> str:  # of the product path's time: what the model alone does not take
            model = (alone.get(r["precision"]) if r["mode"] in ("batched", "collect-stats moments")
                     or r["mode"].startswith("written") else None)
            return "–" if not model else f"{max(0.0, 1 - r['x_realtime'] / model):.0%}"

        out.append(common.markdown_table(
            ["HuBERT-base", "precision", "max_batch_samples", "audio s", "x real time", "TFLOP/s", "padding",
             "host share", "peak MB", "max |Δ|/max", "rel RMS", "stats rel. diff"],
            [[r["mode"], r["precision"], r["max_batch_samples"], f"{r['audio_s']:.0f}", f"{r['x_realtime']:,.0f}",
              common.fmt(r.get("tflops"), 1), "–" if r.get("padding") is None else f"{r['padding']:.1%}",
              host_share(r), common.fmt(r["peak_mb"], 0), sci(r.get("max_rel")), sci(r.get("rel_rms")),
              sci(r.get("stats_rel_diff"))]
             for r in hub]))
    fb = [r for r in rows if r["part"] == "fbank"]
    if fb:
        out.append(common.markdown_table(
            ["fbank", "audio s", "x real time", "peak MB", "max |Δ| vs CPU", "stats rel. diff"],
            [[r["mode"], f"{r['audio_s']:.0f}", f"{r['x_realtime']:,.0f}", common.fmt(r.get("peak_mb"), 0),
              common.fmt(r.get("max_abs_feature_diff"), 7), common.fmt(r.get("stats_rel_diff"), 9)] for r in fb]))
    for part in ("ecapa", "rawnet3"):
        xs = [r for r in rows if r["part"] == part]
        if xs:
            out.append(common.markdown_table(
                [part, "precision", "utts", "utt/s", "audio s/s", "worst cosine vs float32 alone", "peak MB"],
                [[f"batch {r['batch']}", r["precision"], r["utts"], f"{r['utt_per_s']:,.0f}", f"{r['audio_s'] / r['wall_s']:,.0f}",
                  f"{r['min_cosine_vs_alone']:.7f}", common.fmt(r["peak_mb"], 0)] for r in xs]))
    lg = [r for r in rows if r["part"] == "local_gpu"]
    if lg:
        out.append(common.markdown_table(
            ["collect-stats (engine)", "shards", "computed", "wall s", "stats rel. diff vs CPU"],
            [[r["mode"], r["shards"], r["computed"], f"{r['wall_s']:.1f}", common.fmt(r.get("stats_rel_diff"), 9)]
             for r in lg]))
    dp = [r for r in rows if r["part"] == "datapath"]
    if dp:
        out.append(common.markdown_table(
            ["decoding FLAC (load_many)", "utts", "audio s", "audio s/s", "per core used"],
            [[f"{r['threads']} thread(s) of {r['cores']} cores", r["utts"], f"{r['audio_s']:.0f}",
              f"{r['audio_s_per_s']:,.0f}", f"{r['per_core']:,.0f}"] for r in dp]))
    hours = audio_hours(rows)
    if hours and any(str(result.get("device") or "").startswith(k) for k in ("NVIDIA", "AMD Instinct")):
        out.append(common.markdown_table(
            ["audio hours per GPU hour (product path)", "exact float32", "fastest", "fastest at"],
            [[job, "–" if exact is None else f"{exact:,.0f}", "–" if fast is None else f"{fast:,.0f}", how]
             for job, exact, fast, how in hours]))
    out += [f"FAILED {part}: {why}" for part, why in (result.get("failures") or {}).items()]
    return "\n\n".join(out)

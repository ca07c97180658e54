"""Video preprocessing: Stoker's worker pipeline vs transformers' video processor loop, same clips.

Both do the whole per-sample job on the same clips: decode, sample frames, resize, normalize,
patchify and tokenize (chat template + the processor's text expansion). Stoker runs
`stoker dataset stats --decode` (the worker's pipeline on every core, the real Qwen tokenizer);
the baseline decodes every frame with PyAV (transformers' own `read_video_pyav` way) and runs the
preset's `Qwen*Processor` (video processor + tokenizer) clip by clip in one Python process. The
figure that counts is clips per CPU-second (user + system time of each side's processes), since
the machines here are 2 shared cores.

    python benches/video_preprocess.py [--clips 24] [--preset qwen2-vl] [--baseline-clips 8]
        [--ten-bit] [--stoker-before PATH]

`--ten-bit` makes the same mix at 10 bits (HEVC Main 10, H.264 High 10, VP9 profile 2), whose
frames the worker resamples as PyAV's swscale does before converting them to RGB;
`--stoker-before` adds a row for another `stoker` binary on the same clips (what a change cost).

`stoker-lab bench preprocess` runs it with `--baseline-only` for the video rows of its
table (it serves the same clips through S3 and a worker itself).
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/parity"))
CACHE = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache/stoker")
STOKER = os.environ.get("STOKER_BIN", str(CACHE / "target/release/stoker"))
TOKENIZER = Path(os.environ.get("STOKER_TOKENIZER", CACHE / "qwen-tokenizer"))
TEMPLATES = {"qwen2-vl": "qwen2-vl.jinja", "qwen2.5-vl": "qwen2-vl.jinja", "qwen3-vl": "qwen3-vl.jinja"}
# (codec arguments, size, fps, seconds): the mix the clips cycle through.
KINDS = [
    (["-c:v", "libx264", "-pix_fmt", "yuv420p"], "640x360", 30, 8),
    (["-c:v", "libx265", "-pix_fmt", "yuv420p", "-x265-params", "log-level=error"], "480x270", 25, 6),
    (["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"], "640x360", 24, 6),
]
KINDS_10 = [
    (["-c:v", "libx264", "-pix_fmt", "yuv420p10le"], "640x360", 30, 8),
    (["-c:v", "libx265", "-pix_fmt", "yuv420p10le", "-x265-params", "log-level=error"], "480x270", 25, 6),
    (["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-pix_fmt", "yuv420p10le"], "640x360", 24, 6),
]


def make_clips(root: Path, n: int, kinds=KINDS) -> list:
    clips = root / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        codec, size, fps, secs = kinds[i % len(kinds)]
        ext = {"libx264": "mp4", "libx265": "mkv", "libvpx-vp9": "webm"}[codec[1]]
        path = clips / f"c{i}.{ext}"
        if not path.exists():
            subprocess.run([shutil.which("ffmpeg"), "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi",
                            "-i", f"testsrc2=size={size}:rate={fps}", "-t", str(secs), *codec, str(path)], check=True)
        lines.append({"messages": [
            {"role": "user", "content": [{"type": "video", "video": f"clips/{path.name}"},
                                         {"type": "text", "text": "What happens in this clip?"}]},
            {"role": "assistant", "content": "A test pattern moves."}]})
    (root / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    subprocess.run([STOKER, "dataset", "index", str(root)], check=True, capture_output=True)
    return lines


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ours(root: Path, preset: str, n: int, stoker: str = STOKER) -> dict:
    cpu0, t0 = children_cpu(), time.perf_counter()
    subprocess.run([stoker, "dataset", "stats", str(root), "--decode", "--preset", preset,
                    "--tokenizer", str(TOKENIZER), "--json"], check=True, capture_output=True)
    return {"clips": n, "wall_s": time.perf_counter() - t0, "cpu_s": children_cpu() - cpu0}


def baseline(root: Path, lines: list, preset: str, n: int) -> dict:
    import av
    import video_reference as ref

    proc = ref.processor(preset)
    template = (ROOT / "worker/templates" / TEMPLATES[preset]).read_text()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for sample in lines[:n]:
        part = sample["messages"][0]["content"][0]
        with av.open(str(root / part["video"])) as c:
            s = c.streams.video[0]
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
            fps = float(s.average_rate)
        text = proc.tokenizer.apply_chat_template(sample["messages"], chat_template=template, tokenize=False)
        out = proc(text=[text], videos=[frames], return_tensors="pt",
                   videos_kwargs={"do_sample_frames": True, "fps": 2.0, "cap_pixels_per_frame": False,
                                  "video_metadata": {"total_num_frames": len(frames), "fps": fps}})
        assert out["pixel_values_videos"].shape[0] > 0
    return {"clips": n, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", type=int, default=24)
    ap.add_argument("--baseline-clips", type=int, default=8)
    ap.add_argument("--preset", default="qwen2-vl", choices=list(TEMPLATES))
    ap.add_argument("--dir", type=Path, default=CACHE / "bench/video")
    ap.add_argument("--baseline-only", action="store_true",
                    help="make the clips, run only the baseline, print its row as one JSON line")
    ap.add_argument("--ten-bit", action="store_true", help="the same mix at 10 bits")
    ap.add_argument("--stoker-before", help="another stoker binary, run on the same clips")
    a = ap.parse_args()
    root = a.dir.with_name(a.dir.name + "-10bit") if a.ten_bit else a.dir
    lines = make_clips(root, a.clips, KINDS_10 if a.ten_bit else KINDS)
    if a.baseline_only:
        print(json.dumps(baseline(root, lines, a.preset, a.baseline_clips)))
        return
    rows = [("stoker dataset stats --decode (worker pipeline)", ours(root, a.preset, a.clips)),
            ("transformers processor + PyAV, Python loop", baseline(root, lines, a.preset, a.baseline_clips))]
    if a.stoker_before:
        rows.append((f"the same, {Path(a.stoker_before).name}", ours(root, a.preset, a.clips, a.stoker_before)))
    depth = "10-bit " if a.ten_bit else ""
    print(f"\nVideo preprocessing, {a.preset}, {depth}clips of 6-8 s (H.264 640x360@30, H.265 480x270@25, "
          f"VP9 640x360@24), {os.cpu_count()} cores")
    print(f"{'pipeline':<50} {'clips':>6} {'wall s':>8} {'CPU s':>8} {'clips/CPU-s':>12}")
    for name, r in rows:
        print(f"{name:<50} {r['clips']:>6} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r['clips'] / r['cpu_s']:>12.2f}")
    ratio = (rows[0][1]["clips"] / rows[0][1]["cpu_s"]) / (rows[1][1]["clips"] / rows[1][1]["cpu_s"])
    print(f"ours / transformers loop, per CPU-second: {ratio:.1f}x")


if __name__ == "__main__":
    main()

"""Stoker's frame sampling against transformers 5.23's own, swept over clip lengths rather than
a handful of clips: every frame count from 1 to 800 at six frame rates and two target rates,
for each preset, and parts of clips (`video_start` / `video_end`) on a stride of those lengths.

Stoker's side is the worker's own `plan_frames` on a header of that many frames at that rate
(`stoker-lab video-plan`); transformers' side is each video processor's `sample_frames`, read
as transformers' PyAV reader (`read_video_pyav`) reads a clip: it decodes frames 0.. and keeps
those whose number was chosen, so an index past the end — Qwen2-VL's `arange` picks frame
`total` for some lengths, 397 at 25 fps among them — is left out, while the processor's sampled
rate (`VideoMetadata.sampled_fps`, hence Qwen2.5-VL's `second_per_grid_ts`) counts every chosen
index. A part of a clip (`video_reference.part_frames`) is sampled as a clip of that many frames,
numbered in the whole clip. A length transformers cannot sample (it raises) Stoker
refuses by name.
"""

import json
import subprocess
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import LAB, required_module  # noqa: E402

required_module("torch")
import video_reference as ref  # noqa: E402  (torch and transformers)

PRESETS = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]
RATES = [23.976, 24.0, 25.0, 29.97, 30.0, 60000 / 1001]
TARGETS = [2.0, 0.7]
PARTS = [(0.5, None), (None, 3.3), (1.0, 9.0), (4.0, 4.01)]


def clips():
    for preset in PRESETS:
        for video_fps in RATES:
            for fps in TARGETS:
                for frames in range(1, 801):
                    yield {"preset": preset, "frames": frames, "video_fps": video_fps, "fps": fps}
                for frames in range(1, 801, 13):
                    for start, end in PARTS:
                        yield {"preset": preset, "frames": frames, "video_fps": video_fps, "fps": fps,
                               "start": start, "end": end}


def reference(clip):
    """What a transformers user's PyAV pipeline samples: (frames kept, chosen count, seconds
    per grid, Qwen3-VL's timestamps), or None where transformers cannot sample the clip."""
    video_fps = clip["video_fps"]
    first, last = ref.part_frames(clip["frames"], video_fps, clip.get("start"), clip.get("end"))
    if first > last:
        return None
    n = last - first + 1
    try:
        chosen, kept = ref.pyav_indices(clip["preset"], n, video_fps, fps=clip["fps"])
    except (ValueError, ZeroDivisionError):
        return None
    kept = [i + first for i in kept]
    second_per_grid = 2 / (len(chosen) / n * video_fps)
    stamps = ref.processor("qwen3-vl")._calculate_timestamps(list(kept), video_fps, 2)
    return kept, len(chosen), second_per_grid, stamps


def test_every_length_samples_the_frames_transformers_pyav_reader_gives():
    asked = list(clips())
    lines = "".join(json.dumps({k: v for k, v in c.items() if v is not None}) + "\n" for c in asked)
    r = subprocess.run([LAB, "video-plan"], input=lines, capture_output=True, text=True, check=True)
    answers = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(answers) == len(asked)
    past_the_end = refused = 0
    for clip, ours in zip(asked, answers):
        want = reference(clip)
        if want is None:
            assert "error" in ours, (clip, ours)
            refused += 1
            continue
        assert "error" not in ours, (clip, ours)
        kept, chosen, second_per_grid, stamps = want
        assert ours["indices"] == kept, clip
        assert ours["sampled"] == chosen, clip
        past_the_end += chosen > len(kept)
        if clip["preset"] == "qwen2.5-vl":
            assert ours["second_per_grid"] == second_per_grid, clip
        if clip["preset"] == "qwen3-vl":
            assert ours["timestamps"] == stamps, clip
    print(f"\n{len(asked)} clips: {past_the_end} with an index past the end, {refused} refused by both",
          file=sys.stderr)
    # The sweep reaches the cases it is for.
    assert past_the_end > 0 and refused > 0

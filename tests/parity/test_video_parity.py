"""Parity of Stoker's video preprocessing with transformers 5.23's Qwen-VL video processors.

Clips are made here with Debian's ffmpeg (H.264, H.265, VP9 and AV1 in MP4, MKV and WebM; 24,
25, 30 and 59.94 fps, a variable frame rate, a rotated clip, odd sizes, BT.709 and full range, a
clip shorter than 4 frames), plus a frame-list video and a `video_start`/`video_end` part. For every sample and
preset, `stoker dataset inspect --out` writes what Stoker produces, including the sampled frames
as it decoded them; then:

- decoded frames: Stoker's (FFmpeg 5.1 from Debian, through ffmpeg-next) against PyAV's (its own
  FFmpeg 8.1), rotated the same way: equal; a second test sweeps sizes, colour matrices and
  ranges;
- given the same decoded frames (Stoker's, at the positions it sampled), transformers' processor
  (video processor + chat template + tokenizer) must give the same frame indices, the same
  `pixel_values_videos` bit for bit, `video_grid_thw`, `second_per_grid_ts` and token ids —
  Qwen3-VL's `<t seconds>` timestamps included;
- the rope positions of a sample with a video equal the model's own `get_rope_index`.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import MISSING, REQUIRED, STOKER, TOKENIZER, required_module  # noqa: E402

av = required_module("av")
torch = required_module("torch")
import video_reference as ref  # noqa: E402

FFMPEG = shutil.which("ffmpeg")
if FFMPEG is None and REQUIRED:
    pytest.fail(MISSING.format("ffmpeg"), pytrace=False)
pytestmark = pytest.mark.skipif(FFMPEG is None, reason=MISSING.format("ffmpeg"))

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = {"qwen2-vl": "qwen2-vl.jinja", "qwen2.5-vl": "qwen2-vl.jinja", "qwen3-vl": "qwen3-vl.jinja"}
X264, VP9 = ["-c:v", "libx264", "-pix_fmt", "yuv420p"], ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"]
BT709 = ["-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709"]


def cropped(w, h):
    """Output arguments cropping a larger test pattern to w x h (testsrc2 rounds sizes to even)."""
    return ["-vf", f"format=rgb24,crop={w}:{h}:6:4"]

# name: (ffmpeg output arguments, source filter)
CLIPS = {
    "h264.mp4": (["-c:v", "libx264", "-pix_fmt", "yuv420p"], "testsrc2=size=320x240:rate=30", 3.0),
    "vp9.webm": (["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"], "testsrc2=size=318x178:rate=25", 2.0),
    "hevc.mkv": (["-c:v", "libx265", "-pix_fmt", "yuv420p", "-x265-params", "log-level=error"], "testsrc2=size=160x90:rate=24", 1.5),
    "av1.mp4": (["-c:v", "libaom-av1", "-cpu-used", "8", "-row-mt", "1"], "testsrc2=size=200x112:rate=30", 1.0),
    "ntsc.mp4": (["-c:v", "libx264", "-pix_fmt", "yuv420p"], "testsrc2=size=176x144:rate=60000/1001", 2.0),
    "short.mp4": (["-c:v", "libx264", "-pix_fmt", "yuv420p", "-frames:v", "3"], "testsrc2=size=128x96:rate=30", 1.0),
    # 397 frames at 25 fps: Qwen2-VL's arange picks frame 397, which the clip does not have.
    "past-end.mp4": (["-c:v", "libx264", "-pix_fmt", "yuv420p", "-frames:v", "397"], "testsrc2=size=96x64:rate=25", 16.0),
    # Open GOPs and B-frames referenced by B-frames: the worker leaves out H.264's
    # non-reference frames that are not sampled, numbering frames by timestamp (Matroska's
    # first packets carry none to decode by).
    **{f"pyramid.{ext}": (["-c:v", "libx264", "-pix_fmt", "yuv420p", "-x264-params",
                           "open-gop=1:keyint=24:bframes=4:b-pyramid=strict"],
                          "testsrc2=size=224x128:rate=25", 3.0) for ext in ["mp4", "mkv"]},
    # An odd height (VP9 codes any size), BT.709 and full range; and H.264 in full range.
    "odd-bt709-full.webm": ([*cropped(96, 63), *VP9, *BT709, "-color_range", "pc"], "testsrc2=size=112x80:rate=25", 1.0),
    "full.mp4": (["-c:v", "libx264", "-pix_fmt", "yuvj420p", *BT709], "testsrc2=size=128x96:rate=25", 1.0),
    # 10 bits (HEVC Main 10, left chroma siting): every frame takes swscale's scaler.
    "main10.mkv": (["-c:v", "libx265", "-pix_fmt", "yuv420p10le", "-x265-params", "log-level=error"], "testsrc2=size=160x90:rate=24", 1.0),
}


def ffmpeg(*args):
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-y", *args], check=True)


def video(path, **kw):
    return {"type": "video", "video": path, **kw}


def conversation(*parts, text="Describe the video."):
    return {"messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
        {"role": "assistant", "content": "A test pattern."}]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    clips = root / "clips"
    clips.mkdir()
    for name, (codec, src, secs) in CLIPS.items():
        ffmpeg("-f", "lavfi", "-i", src, "-t", str(secs), *codec, str(clips / name))
    # Variable frame rate: the second half at half the rate.
    ffmpeg("-f", "lavfi", "-i", "testsrc2=size=192x108:rate=30", "-t", "2",
           "-vf", "setpts='if(lt(N,30),N,30+(N-30)*2)/30/TB'", "-fps_mode", "vfr",
           "-c:v", "libx264", "-pix_fmt", "yuv420p", str(clips / "vfr.mkv"))
    # Rotation metadata (a display matrix): players, and Stoker, turn the frames upright.
    ffmpeg("-i", str(clips / "h264.mp4"), "-c", "copy", "-metadata:s:v", "rotate=90", str(clips / "rotated.mp4"))
    frames = root / "frames"
    frames.mkdir()
    ffmpeg("-f", "lavfi", "-i", "testsrc2=size=160x120:rate=10", "-t", "0.5", "-q:v", "2",
           str(frames / "f%d.jpg"))
    listed = [f"frames/f{i}.jpg" for i in range(1, 6)]

    lines = [conversation(video(f"clips/{n}")) for n in [*CLIPS, "vfr.mkv", "rotated.mp4"]]
    lines.append(conversation(video("clips/h264.mp4", video_start=0.5, video_end=2.5, fps=1.0)))
    lines.append(conversation(video(listed, fps=2.0)))
    lines.append(conversation({"type": "image", "image": "frames/f1.jpg"}, video("clips/hevc.mkv"),
                        text="Image, then video: the same?"))
    lines.append({"video": "clips/vp9.webm", "conversations": [
        {"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "Colours."}]})
    # One format per shard: the LLaVA line has its own, after the typed parts' (sample ids
    # follow the shards' keys, so line i is still sample i).
    (root / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:-1]))
    (root / "data_llava.jsonl").write_text(json.dumps(lines[-1]) + "\n")
    subprocess.run([STOKER, "dataset", "index", str(root)], check=True, capture_output=True)
    return root, lines


def pyav_frames(path: Path):
    """Every frame as PyAV decodes it (rgb24), the stream's frame count and average rate."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        return np.stack(frames), s.frames or len(frames), float(s.average_rate)


def inspect(root: Path, i: int, preset: str, tmp: Path):
    out = tmp / f"{preset}-{i}.safetensors"
    r = subprocess.run(
        [STOKER, "dataset", "inspect", str(root), "--sample", str(i), "--preset", preset,
         "--tokenizer", str(TOKENIZER), "--pixel-dtype", "f32", "--out", str(out)],
        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return load_file(str(out)), r.stdout


def hf_messages(sample):
    """The sample as transformers' chat template takes it (video items as they are)."""
    if "messages" in sample:
        return sample["messages"]
    return [{"role": "user", "content": [{"type": "video", "video": sample["video"]},
                                         {"type": "text", "text": "\nWhat moves?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Colours."}]}]


def videos_of(sample):
    return [p for m in hf_messages(sample) for p in (m["content"] if isinstance(m["content"], list) else [])
            if p.get("type") == "video"]


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_video_samples_match_transformers(dataset, tmp_path, preset):
    root, lines = dataset
    proc = ref.processor(preset)
    template = (ROOT / "worker/templates" / TEMPLATES[preset]).read_text()
    worst_decode, checked = 0, 0
    for i, sample in enumerate(lines):
        ours, _ = inspect(root, i, preset, tmp_path)
        parts = videos_of(sample)
        grids, seconds, expansions = [], [], []
        for k, part in enumerate(parts):
            frames = ours[f"video_frames_{k}"]
            indices = ours[f"video_indices_{k}"].tolist()
            if isinstance(part["video"], list):
                # A frame list: every frame, dated at its fps; HF takes the frames as given.
                want = ref.process_frames(preset, frames, part.get("fps", 2.0), sampled=False)
                video_fps = part.get("fps", 2.0)
                np.testing.assert_array_equal(want["indices"], np.arange(len(frames)))
            else:
                decoded, total, video_fps = pyav_frames(root / part["video"])
                # Rotated clips: Stoker turns the frames upright (ffmpeg's autorotate); PyAV
                # hands them as coded.
                if decoded.shape[1:3] != frames.shape[1:3]:
                    decoded = np.rot90(decoded, k=1, axes=(1, 2))
                d = np.abs(decoded[indices].astype(int) - frames.astype(int))
                worst_decode = max(worst_decode, int(d.max()))
                assert d.max() == 0, f"{part['video']}: decoded frames differ by {d.max()}"
                # The reference's input: Stoker's own decoded frames where it sampled (the
                # others are never read).
                first, last = ref.part_frames(total, video_fps, part.get("video_start"), part.get("video_end"))
                clip = np.zeros((last - first + 1, *frames.shape[1:]), np.uint8)
                clip[np.asarray(indices) - first] = frames
                want = ref.process_frames(preset, clip, video_fps, sampled=True, fps=part.get("fps", 2.0))
                assert (want["indices"] + first).tolist() == indices, f"sample {i}: frame indices"
            grids.append(want["video_grid_thw"][0])
            if "second_per_grid_ts" in want:
                seconds.append(float(want["second_per_grid_ts"][0]))
            expansions.append((indices, video_fps))
            ours_rows = ours["pixel_values_videos"]
            row = sum(int(np.prod(g)) for g in grids[:-1])
            rows = int(np.prod(grids[-1]))
            d = np.abs(ours_rows[row:row + rows] - want["pixel_values_videos"])
            assert d.max() == 0.0, f"sample {i} video {k}: pixel_values_videos max |Δ| {d.max()}"
            checked += 1
        np.testing.assert_array_equal(ours["video_grid_thw"], np.stack(grids))
        if preset == "qwen2.5-vl":
            np.testing.assert_array_equal(ours["second_per_grid_ts"], np.asarray(seconds, np.float32))
        # Token ids: the chat template's text, each video expanded by the processor.
        text = proc.tokenizer.apply_chat_template(hf_messages(sample), chat_template=template, tokenize=False)
        ids = expand(preset, proc, text, ours, grids, expansions)
        assert ours["input_ids"][0].tolist() == ids, f"sample {i} ({preset}): token ids differ"
    print(f"\n[{preset}] {checked} videos bit-identical given the same frames; decode |Δ| ≤ {worst_decode}",
          file=sys.stderr)
    assert checked >= len(lines)


def expand(preset, proc, text, ours, grids, expansions):
    """The processor's text expansion of images and videos, then its tokenizer."""
    images = []
    if "image_grid_thw" in ours and len(ours["image_grid_thw"]):
        merge = proc.image_processor.merge_size ** 2
        images = ["<|image_pad|>" * int(np.prod(g) // merge) for g in ours["image_grid_thw"]]
    inputs = {"video_grid_thw": torch.as_tensor(np.stack(grids))}
    if preset == "qwen3-vl":
        inputs["video_metadata"] = [ref.VideoMetadata(total_num_frames=len(ix), fps=f, frames_indices=list(ix))
                                    for ix, f in expansions]
    videos = [proc.replace_video_token(inputs, video_idx=k) for k in range(len(grids))]
    out, _ = proc.get_text_with_replacements([text], images_replacements=images, videos_replacements=videos)
    return proc.tokenizer(out[0])["input_ids"]


VIDEO_TOKEN = 151656  # <|video_pad|>
PACK = 8192


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_packed_video_samples_have_the_models_rope_positions(dataset, tmp_path, preset):
    """Packed (`--pack-max-tokens`): each sample of each pack is its unpacked self (tokens, video
    pixels, grids) and its rope rows are the model's `get_rope_index` on it alone."""
    from served import epoch, serve

    root, lines = dataset
    subprocess.run([STOKER, "dataset", "stats", str(root), "--preset", preset, "--tokenizer",
                    str(TOKENIZER), "--write-lengths"], check=True, capture_output=True)
    alone = [inspect(root, i, preset, tmp_path)[0] for i in range(len(lines))]
    proc, addr = serve(root, "--preset", preset, "--pack-max-tokens", str(PACK), global_batch=4)
    checked = 0
    try:
        for b in epoch(addr):
            ids = iter(b.sample_ids)
            for pack in b.packs():
                bounds = pack["cu_seq_lens_q"]
                video_row = video = 0
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    want = alone[next(ids)]
                    tokens = pack["input_ids"][0, lo:hi]
                    np.testing.assert_array_equal(tokens, want["input_ids"][0])
                    n = len(want["video_grid_thw"])
                    grids = pack["video_grid_thw"][video:video + n]
                    np.testing.assert_array_equal(grids, want["video_grid_thw"])
                    rows = int(grids.prod(axis=1).sum())
                    np.testing.assert_array_equal(pack["pixel_values_videos"][video_row:video_row + rows],
                                                  want["pixel_values_videos"])
                    seconds = pack.get("second_per_grid_ts")
                    rope = ref.rope_index(preset, tokens, grids,
                                          None if seconds is None else seconds[video:video + n],
                                          image_grid_thw=want["image_grid_thw"] if len(want["image_grid_thw"]) else None)
                    np.testing.assert_array_equal(pack["position_ids"][1:, 0, lo:hi], rope[:, 0],
                                                  f"{preset}: rope rows of a packed video sample")
                    video, video_row = video + n, video_row + rows
                    checked += 1
    finally:
        proc.kill()
    assert checked == len(lines)


def test_a_packed_video_forward_is_each_samples_own_forward(dataset, tmp_path):
    """A tiny Qwen2-VL (the real model code, tiny widths) on a whole packed batch of videos gives
    every sample the logits of its own unpacked forward."""
    from served import epoch, serve
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration

    root, lines = dataset
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=152064,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2),
    )
    model = Qwen2VLForConditionalGeneration(config).eval()
    subprocess.run([STOKER, "dataset", "stats", str(root), "--preset", "qwen2-vl", "--tokenizer",
                    str(TOKENIZER), "--write-lengths"], check=True, capture_output=True)
    alone = {i: inspect(root, i, "qwen2-vl", tmp_path)[0] for i in range(len(lines))}
    proc, addr = serve(root, "--pack-max-tokens", str(PACK), global_batch=4)
    compared = 0
    try:
        b = epoch(addr)[0]
        ids = iter(b.sample_ids)
        for pack in b.packs(device="cpu"):
            pack.pop("labels")
            if not len(pack["image_grid_thw"]):  # no image in this pack: no vision tower call
                pack.pop("image_grid_thw"), pack.pop("pixel_values")
            kinds = (pack["input_ids"] == VIDEO_TOKEN).int() * 2 + (pack["input_ids"] == IMAGE_TOKEN).int()
            with torch.no_grad():
                packed = model(**pack, mm_token_type_ids=kinds).logits[0]
            bounds = pack["cu_seq_lens_q"].tolist()
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                s = alone[next(ids)]
                inputs = {"input_ids": torch.from_numpy(s["input_ids"]),
                          "pixel_values_videos": torch.from_numpy(s["pixel_values_videos"]),
                          "video_grid_thw": torch.from_numpy(s["video_grid_thw"])}
                if len(s["image_grid_thw"]):
                    inputs.update(pixel_values=torch.from_numpy(s["pixel_values"]),
                                  image_grid_thw=torch.from_numpy(s["image_grid_thw"]))
                kinds = (inputs["input_ids"] == VIDEO_TOKEN).int() * 2 + (inputs["input_ids"] == IMAGE_TOKEN).int()
                with torch.no_grad():
                    own = model(**inputs, mm_token_type_ids=kinds).logits[0]
                torch.testing.assert_close(packed[lo:hi], own, rtol=1e-4, atol=1e-4)
                compared += 1
    finally:
        proc.kill()
    assert compared >= 2


IMAGE_TOKEN = 151655  # <|image_pad|>


# Sizes, formats, colour matrices and ranges, decoded frames only: every odd height up to 9
# reaches the edges of swscale's chroma filter (one or two chroma rows, taps folded at both
# ends); odd widths take swscale's full-chroma output; H.264 and HEVC name left chroma siting.
# name: (width, height, encoder arguments, largest |Δ| against PyAV).
HIGH10 = ["-c:v", "libx265", "-pix_fmt", "yuv420p10le", "-x265-params", "log-level=error"]
SWEEP = {
    **{f"vp9-64x{h}.webm": (64, h, VP9, 0) for h in [1, 3, 5, 7, 9, 17, 63, 127]},
    "vp9-65x64.webm": (65, 64, VP9, 0),
    "vp9-65x63.webm": (65, 63, VP9, 0),
    "vp9-1x9.webm": (1, 9, VP9, 0),
    "vp9-3x5.webm": (3, 5, VP9, 0),
    "av1-96x63.mp4": (96, 63, ["-c:v", "libaom-av1", "-cpu-used", "8", "-row-mt", "1"], 0),
    "vp9-bt709-97x65.webm": (97, 65, [*VP9, *BT709], 0),
    "vp9-full-96x65.webm": (96, 65, [*VP9, "-color_range", "pc"], 0),
    "h264-bt709-96x64.mp4": (96, 64, [*X264, *BT709], 0),
    "h264-full-96x64.mp4": (96, 64, ["-c:v", "libx264", "-pix_fmt", "yuvj420p"], 0),
    "hevc10-96x64.mkv": (96, 64, HIGH10, 0),
    "hevc10-bt709-full-96x64.mkv": (96, 64, [*HIGH10, *BT709, "-color_range", "pc"], 0),
    "h264-high10-96x64.mp4": (96, 64, ["-c:v", "libx264", "-pix_fmt", "yuv420p10le"], 0),
    "vp9-10bit-96x63.webm": (96, 63, [*VP9, "-pix_fmt", "yuv420p10le"], 0),
    "hevc12-96x64.mkv": (96, 64, ["-c:v", "libx265", "-pix_fmt", "yuv420p12le", "-x265-params", "log-level=error"], 0),
    "hevc-444-10bit-96x64.mkv": (96, 64, ["-c:v", "libx265", "-pix_fmt", "yuv444p10le", "-x265-params", "log-level=error"], 0),
    "h264-422-96x63.mp4": (96, 63, ["-c:v", "libx264", "-pix_fmt", "yuv422p"], 0),
    "h264-422-10bit-96x64.mp4": (96, 64, ["-c:v", "libx264", "-pix_fmt", "yuv422p10le"], 0),
    "vp9-444-97x63.webm": (97, 63, [*VP9, "-pix_fmt", "yuv444p"], 0),
    # 10 bits at an odd width: swscale 8.1 interpolates chroma across columns before rows and
    # keeps it at 15 bits into its full-chroma RGB arithmetic; the worker hands 5.1 the rows
    # interpolated first (docs/preprocessing.md).
    "vp9-10bit-97x64.webm": (97, 64, [*VP9, "-pix_fmt", "yuv420p10le"], 2),
    "vp9-10bit-97x63.webm": (97, 63, [*VP9, "-pix_fmt", "yuv420p10le"], 2),
}


def test_decoded_frames_are_pyavs_for_odd_sizes_formats_matrices_and_ranges(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    lines = []
    for name, (w, h, codec, _) in SWEEP.items():
        ffmpeg("-f", "lavfi", "-i", "testsrc2=size=160x144:rate=25", "-t", "0.6", *cropped(w, h), *codec,
               str(clips / name))
        lines.append(conversation(video(f"clips/{name}", fps=24.0)))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    subprocess.run([STOKER, "dataset", "index", str(tmp_path)], check=True, capture_output=True)
    report = []
    for i, name in enumerate(SWEEP):
        ours, _ = inspect(tmp_path, i, "qwen2-vl", tmp_path)
        frames, indices = ours["video_frames_0"], ours["video_indices_0"].tolist()
        decoded, _, _ = pyav_frames(clips / name)
        w, h, _, bound = SWEEP[name]
        assert decoded.shape[1:3] == frames.shape[1:3] == (h, w), name
        d = int(np.abs(decoded[indices].astype(int) - frames.astype(int)).max())
        report.append(f"{name}: {len(indices)} frames, |Δ| {d}")
        assert d <= bound, f"{name}: decoded frames differ by {d}"
    print("\n" + "\n".join(report), file=sys.stderr)

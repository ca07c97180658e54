"""The dataset formats users already have (docs/preprocessing.md, "Dataset formats") give what
the typed-parts form gives, byte for byte.

The same conversations — a single image, several images, a tag at the end of a turn, several
turns, a clip, a video given as frames beside an image named twice, a system prompt, no media —
are written as typed parts, LLaMA-Factory's OpenAI style (JSONL and a JSON array file, with the
top-level `system` key; the array files' media in a folder of their own, given as the media
root), its sharegpt style (with a system turn) and LLaVA. `stoker dataset
inspect --out` on each must write byte-identical tensors (`input_ids`, `labels`,
`pixel_values`, grids, video rows) to the typed-parts form, which the other parity tests hold
equal to the Hugging Face processor. `stoker dataset index` must name each shard's format.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import STOKER, TOKENIZER  # noqa: E402

# A conversation: (system prompt or None, turns); a turn is (role, segments), a segment text
# or ("image" | "video" | "frames", index into the media below).
IMG0, IMG1, CLIP, FRAMES = ("image", 0), ("image", 1), ("video", 0), ("frames", 0)
CONVERSATIONS = {
    "single image": (None, [("user", [IMG0, "Who are they?"]), ("assistant", ["Two people."])]),
    "multi-image": (None, [("user", ["Compare ", IMG0, " with ", IMG1, "?"]), ("assistant", ["Same."])]),
    "tag at the end": (None, [("user", ["Look at this: ", IMG1]), ("assistant", ["A square."])]),
    "multi-turn": (None, [("user", [IMG0, "\nWhat is it?"]), ("assistant", ["A picture."]),
                          ("user", ["And this one ", IMG1, "?"]), ("assistant", ["Another."])]),
    "video": (None, [("user", [CLIP, "What moves?"]), ("assistant", ["Colours."])]),
    "frames and a repeated image": (None, [("user", [IMG0, FRAMES, "Again: ", IMG0]),
                                           ("assistant", ["Seen twice."])]),
    "system prompt": ("Be brief.", [("user", [IMG1, "Hi"]), ("assistant", ["Yo"])]),
    "no media": (None, [("user", ["hello"]), ("assistant", ["hi there"])]),
}
IMAGES = ["media/a.jpg", "media/b.png"]
CLIPS = ["media/clip.mp4"]
FRAME_LISTS = [["media/f0.jpg", "media/f1.jpg", "media/f2.jpg", "media/f3.jpg"]]


def path_of(segment):
    kind, i = segment
    return {"image": IMAGES, "video": CLIPS, "frames": FRAME_LISTS}[kind][i]


def typed(system, turns):
    msgs = [{"role": "system", "content": system}] if system else []
    for role, segs in turns:
        if all(isinstance(s, str) for s in segs):
            msgs.append({"role": role, "content": "".join(segs)})
            continue
        parts = []
        for s in segs:
            if isinstance(s, str):
                parts.append({"type": "text", "text": s})
            else:
                parts.append({"type": "image" if s[0] == "image" else "video", s[0].replace("frames", "video"): path_of(s)})
        msgs.append({"role": role, "content": parts})
    return {"messages": msgs}


def tagged(turns):
    """Each turn's text with tags, and the images and videos in tag order."""
    texts, images, videos = [], [], []
    for role, segs in turns:
        text = ""
        for s in segs:
            if isinstance(s, str):
                text += s
            elif s[0] == "image":
                text += "<image>"
                images.append(path_of(s))
            else:
                text += "<video>"
                videos.append(path_of(s))
        texts.append((role, text))
    return texts, images, videos


def llamafactory_openai(system, turns):
    texts, images, videos = tagged(turns)
    line = {"messages": [{"role": r, "content": t} for r, t in texts]}
    if system:
        line["system"] = system  # the top-level key
    if images:
        line["images"] = images
    if videos:
        line["videos"] = videos
    return line


SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def llamafactory_sharegpt(system, turns):
    texts, images, videos = tagged(turns)
    conv = [{"from": "system", "value": system}] if system else []  # a system turn
    conv += [{"from": SHAREGPT_ROLE[r], "value": t} for r, t in texts]
    line = {"conversations": conv}
    if images:
        line["images"] = [{"path": images[0]}] + images[1:]  # a {"path"} object among paths
    if videos:
        line["videos"] = videos
    return line


def llava(system, turns):
    if any(isinstance(s, tuple) and s[0] == "frames" for _, segs in turns for s in segs):
        return None  # LLaVA's `video` lists clips, not frames
    texts, images, videos = tagged(turns)
    conv = [{"from": "system", "value": system}] if system else []
    conv += [{"from": SHAREGPT_ROLE[r], "value": t} for r, t in texts]
    line = {"conversations": conv}
    if images:
        line["image"] = images[0] if len(images) == 1 else images
    if videos:
        line["video"] = videos[0] if len(videos) == 1 else videos
    return line


FORMATS = {
    "llamafactory-openai": llamafactory_openai,
    "llamafactory-sharegpt": llamafactory_sharegpt,
    "llava": llava,
}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media") / "media"
    root.mkdir()
    rng = np.random.default_rng(5)
    Image.fromarray(rng.integers(0, 256, (300, 420, 3), np.uint8)).save(root / "a.jpg", quality=90)
    Image.fromarray(rng.integers(0, 256, (200, 200, 3), np.uint8)).save(root / "b.png")
    for k in range(4):
        Image.fromarray(rng.integers(0, 256, (112, 140, 3), np.uint8)).save(root / f"f{k}.jpg")
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        pytest.fail("ffmpeg is not installed (scripts/setup-test-deps.sh installs it)")
    subprocess.run([ffmpeg, "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=160x120:rate=10",
                    "-t", "1.2", "-pix_fmt", "yuv420p", str(root / "clip.mp4")], check=True)
    return root


def dataset(tmp: Path, media: Path, name: str, lines, array=False) -> Path:
    """Media beside the shard, or for an array file in a folder of their own (its media root)."""
    ds = tmp / name
    ds.mkdir()
    shutil.copytree(media, (tmp / f"{name}-media" if array else ds) / "media")
    if array:  # LLaMA-Factory's own files: one pretty-printed JSON array
        (ds / "data.json").write_text(json.dumps(lines, indent=2))
        (ds / "dataset_info.json").write_text(json.dumps({name: {"file_name": "data.json"}}))
    else:
        (ds / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ds


def media_root(ds: Path) -> list:
    """`--media-root` for a dataset whose media lie apart."""
    apart = ds.parent / f"{ds.name}-media"
    return ["--media-root", str(apart)] if apart.exists() else []


def inspect(ds: Path, i: int, preset: str, out: Path) -> dict:
    r = subprocess.run(
        [STOKER, "dataset", "inspect", str(ds), "--sample", str(i), "--preset", preset,
         "--tokenizer", str(TOKENIZER), "--pixel-dtype", "f32", "--out", str(out)] + media_root(ds),
        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return load_file(str(out))


def index(ds: Path, *extra) -> str:
    r = subprocess.run([STOKER, "dataset", "index", str(ds), "--dry-run", *extra], capture_output=True, text=True)
    assert r.returncode == 0 or "--allow-bad" in extra, r.stderr
    return r.stdout + r.stderr


def assert_same_tensors(got: dict, want: dict, what: str):
    """The same tensors, byte for byte (dtype and shape too)."""
    assert sorted(got) == sorted(want), f"{what}: tensors {sorted(got)}"
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, (what, key)
        assert got[key].tobytes() == value.tobytes(), f"{what}: {key} differs"


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen3-vl"])
def test_every_format_gives_the_typed_parts_tensors(media, tmp_path, preset):
    names = list(CONVERSATIONS)
    reference = dataset(tmp_path, media, "typed-parts", [typed(*CONVERSATIONS[n]) for n in names])
    assert "data.jsonl: format: typed-parts, 8 samples, 0 bad lines" in index(reference)
    want = {n: inspect(reference, i, preset, tmp_path / f"ref-{i}.st") for i, n in enumerate(names)}
    assert any("pixel_values_videos" in t for t in want.values()), "no video was checked"
    checked = 0
    for fmt, write in FORMATS.items():
        for array in (False, True):
            kept = [n for n in names if write(*CONVERSATIONS[n]) is not None]
            lines = [write(*CONVERSATIONS[n]) for n in kept]
            ds = dataset(tmp_path, media, f"{fmt}{'-array' if array else ''}", lines, array)
            shard = "data.json" if array else "data.jsonl"
            assert f"{shard}: format: {fmt}, {len(kept)} samples, 0 bad lines" in index(ds, *media_root(ds))
            if array:  # without its media root every sample with media names a missing object
                assert "does not exist" in index(ds, "--allow-bad")
            for i, n in enumerate(kept):
                assert_same_tensors(inspect(ds, i, preset, tmp_path / f"{fmt}-{array}-{i}.st"), want[n],
                                    f"{fmt} {n!r}")
                checked += 1
    assert checked == 2 * (3 * len(names) - 1)

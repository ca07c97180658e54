"""Parquet datasets with embedded images (the Hub's vision SFT sets) give what the same
conversations as typed JSONL with image files give, byte for byte.

The image conversations of the dataset-format test are written as Parquet in the shapes the Hub
holds: the `datasets` library's schema (`messages: list<{role, content: list<{type, text,
index}>}>`, image parts `{"type": "image", "index": i}` into an `images` column of its `Image`
feature, embedded bytes), written by `datasets` itself (no page index: the Hub's files) and by
pyarrow with a page index and small row groups and pages; LLaMA-Factory's OpenAI style with
`<image>` tags; sharegpt `conversations` whose images name a path (bytes null); and columns of
other names, mapped with `--columns`. `stoker dataset inspect` on each sample must write the
typed JSONL's `input_ids`, `labels`, `pixel_values` and grids byte for byte, and a worker's epoch
with the same seed must serve the same batches. A row whose tags and images differ in number is
a bad row, named.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import STOKER, TOKENIZER, epoch, required_module, serve  # noqa: E402
from test_dataset_formats import (  # noqa: E402
    CONVERSATIONS, IMAGES, assert_same_tensors, dataset, index, inspect, llamafactory_openai,
    llamafactory_sharegpt, media, typed,
)

pa = required_module("pyarrow")
pq = required_module("pyarrow.parquet")

_ = media  # the fixture, shared with the dataset-format test
NAMES = [n for n, (_, turns) in CONVERSATIONS.items()
         if not any(isinstance(s, tuple) and s[0] != "image" for _, segs in turns for s in segs)]


def hub_row(system, turns, media_dir: Path, message_key="messages", image_key="images"):
    """The `datasets` schema: every content a list of parts, image parts by index, images
    embedded as the Image feature's {bytes, path}."""
    messages, images = [], []
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system, "index": None}]})
    for role, segs in turns:
        parts = []
        for s in segs:
            if isinstance(s, str):
                parts.append({"type": "text", "text": s, "index": None})
            else:
                path = IMAGES[s[1]]
                parts.append({"type": "image", "text": None, "index": len(images)})
                images.append({"bytes": (media_dir.parent / path).read_bytes(), "path": Path(path).name})
        messages.append({"role": role, "content": parts})
    return {message_key: messages, image_key: images}


def embedded(line, media_dir: Path):
    """A tag format's row: its listed image paths as embedded Image values."""
    row = dict(line)
    row["images"] = [{"bytes": (media_dir.parent / (p["path"] if isinstance(p, dict) else p)).read_bytes(),
                      "path": None} for p in line.get("images", [])]
    return row


def by_path(line):
    """A tag format's row whose images name their paths (bytes null), beside the shard."""
    row = dict(line)
    row["images"] = [{"bytes": None, "path": p["path"] if isinstance(p, dict) else p}
                     for p in line.get("images", [])]
    return row


IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def write(ds: Path, rows, **options):
    """Rows as `data.parquet` with pyarrow; the image column typed as the Image feature."""
    ds.mkdir()
    keys = list(dict.fromkeys(k for r in rows for k in r))  # pyarrow takes the first row's alone
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])
    for name in ("images", "pictures"):
        if name in table.column_names:
            i = table.column_names.index(name)
            table = table.set_column(i, name, table.column(name).cast(pa.list_(IMAGE)))
    pq.write_table(table, ds / "data.parquet", **options)
    return ds


def write_with_datasets(ds: Path, rows):
    """Rows as the `datasets` library writes a Hub dataset (its Image feature, its row groups,
    no page index)."""
    datasets = required_module("datasets")
    ds.mkdir()
    d = datasets.Dataset.from_list(rows)
    d = d.cast_column("images", datasets.List(datasets.Image()))
    d.to_parquet(str(ds / "data.parquet"))
    return ds


def check_shard(ds: Path, fmt: str, rows: int, groups: int, columns: str, *extra):
    got = index(ds, *extra)
    want = (f"data.parquet: format: parquet ({fmt}), {rows} rows in {groups} row groups, columns "
            f"{columns}, {rows} samples, 0 bad rows")
    assert want in got, got


@pytest.fixture(scope="module")
def shards(media, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parquet")
    convs = [CONVERSATIONS[n] for n in NAMES]
    reference = dataset(tmp, media, "typed", [typed(*c) for c in convs])
    hub = [hub_row(*c, media) for c in convs]
    out = {
        "datasets-library": write_with_datasets(tmp / "datasets-library", hub),
        "page-index": write(tmp / "page-index", hub, row_group_size=2, write_page_index=True,
                            data_page_size=16 << 10),
        "openai-tags": write(tmp / "openai-tags", [embedded(llamafactory_openai(*c), media) for c in convs],
                             row_group_size=4),
        "sharegpt-paths": write(tmp / "sharegpt-paths", [by_path(llamafactory_sharegpt(*c)) for c in convs]),
        "mapped-columns": write(tmp / "mapped-columns", [hub_row(*c, media, "dialogue", "pictures") for c in convs],
                                write_page_index=True),
    }
    shutil.copytree(media, out["sharegpt-paths"] / "media")
    return reference, out


def test_every_parquet_shape_is_indexed_with_its_columns(shards):
    _, out = shards
    n = len(NAMES)
    meta = pq.ParquetFile(out["datasets-library"] / "data.parquet").metadata
    check_shard(out["datasets-library"], "typed-parts", n, meta.num_row_groups, "messages=messages,images=images")
    check_shard(out["page-index"], "typed-parts", n, (n + 1) // 2, "messages=messages,images=images")
    check_shard(out["openai-tags"], "llamafactory-openai", n, (n + 3) // 4,
                "messages=messages,images=images,system=system")
    check_shard(out["sharegpt-paths"], "llamafactory-sharegpt", n, 1, "messages=conversations,images=images")
    refused = index(out["mapped-columns"], "--allow-bad")
    assert 'no "messages" or "conversations" column (columns: dialogue, pictures)' in refused, refused
    # Written (not --dry-run): the worker below serves it with the mapping the index records.
    r = subprocess.run([STOKER, "dataset", "index", str(out["mapped-columns"]), "--format", "parquet",
                        "--columns", "messages=dialogue,images=pictures"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"columns messages=dialogue,images=pictures, {n} samples, 0 bad rows" in r.stdout, r.stdout
    r = subprocess.run([STOKER, "dataset", "index", str(out["page-index"]), "--dry-run", "--format", "jsonl"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "data.parquet is not a JSONL shard (--format)" in r.stderr, r.stderr


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen3-vl"])
def test_each_row_gives_the_typed_jsonl_tensors(shards, tmp_path, preset):
    reference, out = shards
    want = [inspect(reference, i, preset, tmp_path / f"ref-{i}.st") for i in range(len(NAMES))]
    for shape, ds in out.items():
        for i, name in enumerate(NAMES):
            assert_same_tensors(inspect(ds, i, preset, tmp_path / f"{shape}-{i}.st"), want[i], f"{shape} {name!r}")


def test_a_served_epoch_is_the_typed_jsonl_epoch(shards):
    reference, out = shards
    epochs = {}
    for name, ds in [("typed", reference), ("page-index", out["page-index"]),
                     ("datasets-library", out["datasets-library"])]:
        proc, addr = serve(ds, "--seed", "11", global_batch=2)
        try:
            epochs[name] = epoch(addr)
        finally:
            proc.kill()
    want = epochs.pop("typed")
    assert sum(len(b.sample_ids) for b in want) == len(NAMES)
    for name, got in epochs.items():
        assert [b.sample_ids for b in got] == [b.sample_ids for b in want], name
        for g, w in zip(got, want):
            assert sorted(g.tensors) == sorted(w.tensors), name
            for key in w.tensors:
                assert bytes(g.tensors[key]) == bytes(w.tensors[key]), f"{name}: {key} differs"


def test_a_row_whose_tags_and_images_differ_is_a_bad_row(media, tmp_path):
    rows = [embedded(llamafactory_openai(*CONVERSATIONS[n]), media) for n in NAMES[:3]]
    rows[1]["images"] = rows[1]["images"][:1] + rows[1]["images"]  # one image more than its tags
    rows[2]["images"][0] = {"bytes": None, "path": None}
    ds = write(tmp_path / "bad", rows)
    r = subprocess.run([STOKER, "dataset", "index", str(ds), "--dry-run"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "data.parquet: format: parquet (llamafactory-openai), 3 rows in 1 row groups" in r.stdout
    assert "1 samples, 2 bad rows" in r.stdout, r.stdout
    assert "bad line data.parquet:1: " in r.stderr and "tags in the text but" in r.stderr, r.stderr
    assert 'bad line data.parquet:2: images[0]: an image with neither "bytes" nor a "path"' in r.stderr, r.stderr


def test_a_page_over_max_object_bytes_is_refused_by_name_never_read(media, tmp_path):
    """pyarrow's page index alone closes a page per 1,024 rows: every image in one page. A read
    over --max-object-bytes is refused naming it and the rewrite, the file never read whole."""
    rows = [hub_row(*CONVERSATIONS[n], media) for n in NAMES]
    ds = write(tmp_path / "one-page", rows, write_page_index=True)
    group = pq.ParquetFile(ds / "data.parquet").metadata.row_group(0)
    # Half the image column: more than any image, less than its one page (or dictionary page).
    cap = max(group.column(i).total_compressed_size for i in range(group.num_columns)) // 2
    r = subprocess.run([STOKER, "dataset", "inspect", str(ds), "--sample", "0", "--tokenizer", str(TOKENIZER),
                        "--max-object-bytes", str(cap)], capture_output=True, text=True)
    assert r.returncode != 0
    assert f"is over {cap} (max-object-bytes)" in r.stderr and "write_page_index=True" in r.stderr, r.stderr
    ok = subprocess.run([STOKER, "dataset", "inspect", str(ds), "--sample", "0", "--tokenizer", str(TOKENIZER)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr

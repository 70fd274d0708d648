"""armserve's GGUF header reader (model_loader/gguf_reader.py) against gguf's GGUFReader: every field's
parts, data indices, types and contents, and every tensor, the same on a written file with each kind
of metadata and on the bundled SmolLM2 GGUF."""

from __future__ import annotations

import os

import numpy as np
import torch
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from armserve.model_loader.gguf_reader import LazyGGUFReader


def _assert_same(path: str) -> None:
    a, b = GGUFReader(path), LazyGGUFReader(path)
    assert list(a.fields) == list(b.fields)
    for name, fa in a.fields.items():
        fb = b.fields[name]
        assert (fb.offset, fb.name, list(fb.types)) == (fa.offset, fa.name, list(fa.types))
        assert list(fb.data) == list(fa.data), name
        assert len(fb.parts) == len(fa.parts), name
        for pa, pb in zip(fa.parts, fb.parts):
            assert pb.dtype == pa.dtype and pb.shape == pa.shape and np.array_equal(pb, pa), name
        assert [p.dtype for p in fb.parts[-3:]] == [p.dtype for p in fa.parts[-3:]], name  # (negative indices)
        assert fb.contents() == fa.contents(), name
        if fa.data:
            assert fb.contents(0) == fa.contents(0), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in b.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in a.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(ta.data, tb.data)


def test_every_kind_of_metadata_reads_as_ggufreader_reads_it(tmp_path):
    path = str(tmp_path / "meta.gguf")
    w = GGUFWriter(path, "llama")
    w.add_string("s.plain", "hello")
    w.add_string("s.empty", "")
    w.add_array("a.strings", ["a", "", "ünïcödé ✓", "<|endoftext|>", "Ġthe"] * 50)
    w.add_array("a.empty", [])
    w.add_key_value("a.u8", [0, 1, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    w.add_key_value("a.i16", [-5, 7], GGUFValueType.ARRAY, GGUFValueType.INT16)
    w.add_key_value("a.i32", list(range(-100, 100)), GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value("a.u64", [2**40, 3], GGUFValueType.ARRAY, GGUFValueType.UINT64)
    w.add_key_value("a.f32", [0.5, -1.25, 3.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    w.add_key_value("a.f64", [1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64)
    w.add_key_value("a.bool", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    w.add_array("a.nested", [[1, 2], [3]])  # (an array of arrays: read as GGUFReader reads it)
    w.add_uint32("n.u32", 7)
    w.add_float32("n.f32", 0.25)
    w.add_bool("n.bool", True)
    w.add_tensor("t.a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("t.b", np.ones(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(path)


@pytest.mark.needs_model
def test_a_real_vocabulary_reads_as_ggufreader_reads_it(smollm2_gguf):
    _assert_same(smollm2_gguf)  # 49k tokens and merges


def test_a_gguf_release_the_lazy_reader_does_not_fit_falls_back_to_ggufreader(tmp_path, monkeypatch, caplog):
    from armserve.model_loader import gguf as loader
    from armserve.model_loader import gguf_reader

    path = str(tmp_path / "meta.gguf")
    w = GGUFWriter(path, "llama")
    w.add_array("a.strings", ["x", "yz"])
    w.add_tensor("t.a", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    def changed(self, *args):  # (as if a gguf release renamed a private helper the lazy reader calls)
        raise AttributeError("'LazyGGUFReader' object has no attribute '_get'")

    monkeypatch.setattr(gguf_reader.LazyGGUFReader, "_array_field", changed)
    monkeypatch.setattr(loader, "_READER", None)
    with caplog.at_level("WARNING", logger=loader.__name__):
        reader = loader._reader(path)
    assert type(reader) is not gguf_reader.LazyGGUFReader and isinstance(reader, GGUFReader)
    assert "lazy GGUF header reader does not fit" in caplog.text
    assert reader.fields["a.strings"].contents() == ["x", "yz"]


@pytest.mark.parametrize("model", ["smollm2_gguf", "qwen_coder_gguf", "gemma3_gguf"])
def test_a_config_read_without_the_vocabulary_is_the_same_config(model, request, monkeypatch):
    """A load whose tokenizer comes from the cache reads the config without converting the
    vocabulary: the same config as transformers makes from the whole header (Qwen2.5's and Gemma
    3's headers have no vocab_size, which transformers takes from the token count), and no
    vocabulary item goes through transformers' value parsing."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from armserve.model_loader import gguf as gguf_loader
    from armserve.model_source import resolve_model_path

    src = resolve_model_path(request.getfixturevalue(model))
    full = gguf_loader.read_config(src, vocabulary=True).to_dict()
    gguf_loader.release_reader()
    parsed = []
    original = hf_gguf._gguf_parse_value
    monkeypatch.setattr(hf_gguf, "_gguf_parse_value", lambda *a: parsed.append(1) or original(*a))
    lean = gguf_loader.read_config(src, vocabulary=False).to_dict()
    gguf_loader.release_reader()
    assert lean == full
    assert 0 < len(parsed) < 1000, len(parsed)


def _resident_pages(path: str) -> int:
    """Pages of this process's mappings of `path` that are present (bit 63 of /proc/self/pagemap;
    readable without privileges, which only zero the frame numbers)."""
    import struct

    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((a, b))
    assert ranges, "the file is not mapped"
    present = 0
    with open("/proc/self/pagemap", "rb") as f:
        for a, b in ranges:
            f.seek(a // 4096 * 8)
            data = f.read((b - a) // 4096 * 8)
            present += sum(struct.unpack_from("<Q", data, i)[0] >> 63 for i in range(0, len(data), 8))
    return present


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux /proc/self/pagemap")
def test_a_load_leaves_no_page_of_the_file_resident_but_the_rows_looked_up(tmp_path):
    """An untied token table stays where the file is mapped (MappedEmbedding); once the load is
    over, none of the file's pages count in the process (not the header read for the config, nor
    the pages mapped around each converted tensor), and a lookup brings in only its rows' pages."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from transformers import LlamaConfig

    from armserve.model_loader import gguf as loader
    from armserve.models.llama import LlamaForCausalLM
    from armserve.quantization.embedding import MappedEmbedding

    rng = np.random.default_rng(0)
    vocab, hidden = 4096, 256
    path = str(tmp_path / "untied.gguf")
    w = GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token{i:05d}" * 8 for i in range(vocab)])  # ~1 MB of header
    for name, shape in [("token_embd.weight", (vocab, hidden)), ("output.weight", (vocab, hidden)),
                        ("blk.0.ffn_up.weight", (512, hidden))]:
        q8 = GGMLQuantizationType.Q8_0
        w.add_tensor(name, quantize(rng.standard_normal(shape, dtype=np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loader.release_reader()
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=4, num_hidden_layers=1)
    weights = dict(loader.iter_weights(path, config, LlamaForCausalLM))
    table = weights["model.embed_tokens.weight"]
    assert type(table).__name__ == "GGUFRows", type(table)
    assert _resident_pages(path) == 0
    rows = MappedEmbedding(table, torch.float32)(torch.tensor([0, 1, vocab - 1]))
    assert rows.shape == (3, hidden) and rows.abs().sum() > 0
    # two rows at the start, one at the end: a few pages each, plus fault-around's neighbours
    assert 0 < _resident_pages(path) <= 3 * 16 + 8, _resident_pages(path)

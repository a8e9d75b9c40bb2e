"""Warm start (`dflash-ds init-drafter --from EXPORT --kind dspark|dflash2`, models/warm_start.py): a DSpark and a
DFlash2 drafter made from a trained DFlash export draft exactly as it at step 0, token for token, and decode the
same steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_ds.cli import main
from dflash_ds.models.drafter import DFlashDrafter


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_warm_start_drafts_as_its_source(kind, trained_drafter, target, prompts, tmp_path: Path) -> None:
    from dflash_ds.eval.speculative import eos_token_ids, speculative_generate
    from dflash_ds.models.target import capture_hidden

    source = trained_drafter.save_pretrained(tmp_path / "dflash")
    out = tmp_path / kind
    assert main(["init-drafter", "--from", str(source), "--kind", kind, "--out", str(out), "--seed", "3",
                 *(["--selector-top-k", "4"] if kind == "dflash2" else ["--markov-rank", "32"])]) == 0
    warm = DFlashDrafter.from_pretrained(out).eval()
    assert warm.kind == kind
    # The warm start as models/warm_start.py defines it, part by part (a small random part would still draft the
    # source's argmax on this target, so the drafts below cannot tell): the backbone copied, the added parts that
    # draft at zero or identity.
    src, new = trained_drafter.state_dict(), warm.state_dict()
    assert all(torch.equal(new[k], src[k]) for k in src if not k.startswith("rotary_emb."))
    if kind == "dspark":
        assert not new["markov_head.markov_w2.weight"].any()  # the bias w2 @ w1[prev] is 0
        assert new["markov_head.markov_w1.weight"].std() > 0 and new["confidence_head.proj.weight"].std() > 0
    else:
        assert not new["candidate_selector.successor_codebook"].any()  # every edge score is 0
        assert new["candidate_selector.predecessor_codebook"].std() > 0
        convs = {k.rsplit(".", 1)[0] for k in new if k.endswith("_conv.base_kernel")}
        assert len(convs) == 2 * warm.arch.num_hidden_layers
        for conv in convs:  # identity: tap 0 is 1, later taps and the per-token projection 0
            kernel = new[f"{conv}.base_kernel"]
            assert torch.equal(kernel[:, 0], torch.ones_like(kernel[:, 0])) and not kernel[:, 1:].any()
            assert not new[f"{conv}.kernel_projection.weight"].any()
    head = target.get_output_embeddings()
    # Every block of the prompts, drafted in one pass: the new kind's sequential draft is the source's argmax.
    ids = torch.tensor([prompts[0] + prompts[1][: len(prompts[0])]])
    context, _ = capture_hidden(target, ids, None, warm.arch.target_layer_ids)
    anchors = torch.arange(1, ids.shape[1] - warm.block_size).view(1, -1)
    blocks = torch.full((1, anchors.shape[1], warm.block_size), warm.arch.mask_token_id)
    blocks[..., 0] = ids[0, anchors[0]]
    embeds = target.get_input_embeddings()(blocks)
    with torch.no_grad():
        h_src = trained_drafter.forward_train(context, embeds, anchors)[0, :, 1:]
        h_new = warm.forward_train(context, embeds, anchors)[0, :, 1:]
        assert torch.equal(h_src, h_new)  # the backbone is the source's (and DFlash2's convolutions the identity)
        draft = warm.draft_tokens(h_new, head, blocks[0, :, 0])
    assert torch.equal(draft.tokens, head(h_src).argmax(-1))
    assert anchors.shape[1] * (warm.block_size - 1) >= 200  # a real comparison: hundreds of drafted tokens
    # And decoding: the same steps and tokens as the source on every prompt.
    eos = eos_token_ids(target)
    for prompt in prompts:
        a = speculative_generate(target, prompt, drafter=trained_drafter, max_new_tokens=24, eos_ids=eos)
        b = speculative_generate(target, prompt, drafter=warm, max_new_tokens=24, eos_ids=eos)
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths


def test_warm_start_refusals(trained_drafter, tmp_path: Path, capsys) -> None:
    source = trained_drafter.save_pretrained(tmp_path / "dflash")
    assert main(["init-drafter", "--from", str(source), "--kind", "dspark", "--out", str(tmp_path / "ds")]) == 0
    for args, message in (
            (["--from", str(tmp_path / "ds"), "--kind", "dflash2", "--out", str(tmp_path / "x")],
             "builds a dflash2 or dspark drafter from a dflash export; this one is dspark"),
            (["--from", str(source), "--target", str(source), "--out", str(tmp_path / "y")], "drop --target"),
            (["--from", str(source), "--kind", "dspark", "--out", str(tmp_path / "ds")], "is not empty"),
            (["--out", str(tmp_path / "z")], "give --target (a new drafter) or --from")):
        assert main(["init-drafter", *args]) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # A drafter of the same kind (a released DSpark drafter, say) is taken as it is, to fine-tune.
    assert main(["init-drafter", "--from", str(tmp_path / "ds"), "--kind", "dspark", "--out", str(tmp_path / "ds2")]) == 0
    a, b = (DFlashDrafter.from_pretrained(tmp_path / name).state_dict() for name in ("ds", "ds2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

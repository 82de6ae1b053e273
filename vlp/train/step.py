"""One optimizer step's gradients over `accum_steps` micro-batches (contrastive accumulation).

k = 1: one forward/backward. k > 1 (GradCache / open_clip accum_freq): embed every micro-batch
without grad, then re-embed each with grad against the cached features of the others;
micro-batch j's backward gives exactly the global loss's gradient w.r.t. its own features, so
k micro-batches of b equal one batch of k·b (tests/train/test_trainer_accum.py). logit_scale/bias get
their gradient once (in the last micro-step). Gradients are synced only on the last backward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch


def contrastive_backward(model, strategy, loss_of: Callable, micro_batches: list, device,
                         trim_text: Callable, all_finite: Callable,
                         prepare: Optional[Callable] = None) -> tuple[torch.Tensor, dict]:
    """Backward of the global loss; (loss, metrics), metrics empty when the loss is not finite
    on some rank (then nothing was backpropagated). `loss_of(img, txt, scale, bias, ids)` is the
    loss over the gathered batch; `all_finite(loss)` agrees across ranks. `prepare`: the device
    half of the image transform (vlp.data.device.DeviceImages: uint8 -> normalised float)."""
    features = micro_batches[0].features
    images = [b.image.to(device, non_blocking=True) for b in micro_batches]
    if prepare is not None and not features:
        images = [prepare(x) for x in images]
    # drop all-padding text columns on the host (no device sync; exact, see DualEncoder); cached
    # features (Batch.features: stem outputs, vlp.train.feature_cache) are no tokens: never trimmed
    texts = [(b.text if features else trim_text(b.text)).to(device, non_blocking=True) for b in micro_batches]

    def forward(image, text):  # features: only the heads run (a forward keyword, so DDP passes it on)
        return model(image, text, features=True) if features else model(image, text)

    ids = torch.cat([b.sample_id for b in micro_batches])  # every local anchor's (stateful losses)
    if len(micro_batches) == 1:
        out = forward(images[0], texts[0])
        loss, metrics = loss_of(out.image_emb, out.text_emb, out.logit_scale, out.logit_bias, ids)
        if not all_finite(loss):
            return loss, {}
        strategy.backward(loss)
        return loss, metrics
    with torch.no_grad():
        cached = [forward(x, t) for x, t in zip(images, texts)]
        img_cache, txt_cache = [c.image_emb for c in cached], [c.text_emb for c in cached]
        # the non-finite check is made on the no-grad loss so every micro-step agrees
        loss0, _ = loss_of(torch.cat(img_cache), torch.cat(txt_cache), cached[0].logit_scale,
                           cached[0].logit_bias, ids)
    if not all_finite(loss0):
        return loss0, {}
    for j in range(len(micro_batches)):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else strategy.no_sync(model):
            out = forward(images[j], texts[j])
            img = torch.cat(img_cache[:j] + [out.image_emb] + img_cache[j + 1:])
            txt = torch.cat(txt_cache[:j] + [out.text_emb] + txt_cache[j + 1:])
            scale, bias = out.logit_scale, out.logit_bias
            if not last:
                scale, bias = scale.detach(), None if bias is None else bias.detach()
            loss, metrics = loss_of(img, txt, scale, bias, ids)
            strategy.backward(loss)
    return loss, metrics

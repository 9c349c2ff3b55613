"""Small PyTorch models for the own-model check's tutorial and tests (torch imported inside
the functions: the suite does not depend on it)."""

from __future__ import annotations

__all__ = ["tiny_transformer"]


def tiny_transformer(vocab=11, d=8, heads=2, seq=5, classes=3, *, causal=False, seed=0,
                     dtype=None):
    r"""A one-block pre-LayerNorm transformer classifier over token ids ``[N, seq]``:

    .. math::

        x = \mathrm{emb}(\text{ids}) + P, \quad
        h = x + \mathrm{attn}(\mathrm{ln1}(x)), \quad
        z = h + \mathrm{ff2}(\tanh(\mathrm{ff1}(\mathrm{ln2}(h)))), \quad
        f = \mathrm{head}\big(\tfrac{1}{\text{seq}}\textstyle\sum_s z_s\big)

    with ``emb`` an ``nn.Embedding(vocab, d)``, ``P`` a learned ``[seq, d]`` position table
    (a plain parameter), ``attn`` an ``nn.MultiheadAttention(d, heads, batch_first=True)``
    (self-attention, causal with ``causal=True``), ``ff1`` ``d → 2d``, ``ff2`` ``2d → d``
    and ``head`` ``d → classes`` ``nn.Linear``\ s.  Its K-FAC layers in
    :func:`~conformance.own_model.reference_torch_kfac`: ``emb`` (embedding), ``ln1``,
    ``ln2`` (scale-and-shift), ``attn.in_proj``, ``attn.out_proj``, ``ff1``, ``ff2``,
    ``head`` (dense, ``|T| = seq`` except ``head``).  Weights drawn from ``seed``;
    ``dtype`` (default float64)."""
    import torch
    from torch import nn

    class TinyTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(0.1 * torch.randn(seq, d))
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.ff1 = nn.Linear(d, 2 * d)
            self.ff2 = nn.Linear(2 * d, d)
            self.head = nn.Linear(d, classes)
            self.causal = causal

        def forward(self, ids):
            x = self.emb(ids) + self.pos[:ids.shape[1]]
            a = self.ln1(x)
            mask = None
            if self.causal:
                s = ids.shape[1]
                mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
            h = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
            z = h + self.ff2(torch.tanh(self.ff1(self.ln2(h))))
            return self.head(z.mean(dim=1))

    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = TinyTransformer()
        with torch.no_grad():  # a scale and shift away from their initial 1 and 0
            for ln in (model.ln1, model.ln2):
                ln.weight.add_(0.3 * torch.randn(d))
                ln.bias.add_(0.1 * torch.randn(d))
    return model.to(torch.float64 if dtype is None else dtype).eval()

"""The own-model reference for the layers people train (issue 32 §7): attention, modules
called several times, residual graphs, scale-and-shift (LayerNorm / BatchNorm / GroupNorm),
embeddings, Conv1d / Conv3d and grouped convolutions — each against an oracle that does not
use the code under test (per-example autograd gradients, hand formulas and loops, or the
same layer written another way through the plain nn.Linear / nn.Conv2d path)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from conformance.own_model import check_torch_kfac, reference_torch_kfac  # noqa: E402

RTOL = 1e-12  # float64 throughout


def _rel(x, ref):
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _agree(x, ref, rtol=RTOL):
    """``x`` equals ``ref`` to ``rtol``, and ``ref`` is not trivially matched (twice it, or
    it with one entry moved, would fail: the comparison can fail)."""
    r = _rel(x, ref)
    assert r <= rtol, r
    assert _rel(2 * np.asarray(ref), ref) > rtol
    return r


def _per_example_fisher(model, x, params, n_out):
    """Exact per-example Fisher block of the squared error ½‖f − y‖² (Fisher factor = I):
    Σ_k vec_r(∇_θ f_k) vec_r(∇_θ f_k)ᵀ over the outputs k of the single example, by
    autograd, ``params`` a list of tensors flattened row-major and concatenated."""
    out = model(x)
    assert out.shape[0] == 1
    rows = []
    for k in range(n_out):
        gs = torch.autograd.grad(out[0, k], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for g, p in zip(gs, params, strict=True)]))
    d = torch.stack(rows).detach().numpy()
    return d.T @ d


def _kron_block(entry):
    """A ⊗ G as the Fisher block of the row-major ``[W | b]`` (``[out, in(+1)]``): G ⊗ A."""
    return np.kron(entry["G"], entry["A"])


# -- nn.MultiheadAttention --------------------------------------------------------------

E, HEADS, L, S, CLASSES = 6, 2, 4, 3, 3


class _MHANet(nn.Module):
    """x [N, L, E] -> attention -> mean over positions -> Linear head."""

    def __init__(self, *, batch_first=True, bias=True, cross=False, kdim=None, masks=False,
                 need_weights=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first,
                                          kdim=kdim, vdim=kdim)
        self.ctx = nn.Linear(E, kdim or E) if cross else None
        self.head = nn.Linear(E, CLASSES)
        self.batch_first, self.cross, self.masks = batch_first, cross, masks
        self.need_weights = need_weights

    def qkv(self, x):
        if not self.cross:
            return x, x, x
        c = self.ctx(x[:, :S])
        return x, torch.tanh(c), torch.sin(c)

    def mask_args(self, x):
        if not self.masks:
            return {}
        lk = S if self.cross else L
        causal = torch.ones(L, lk, dtype=torch.bool).triu(1)
        kpm = torch.zeros(x.shape[0], lk, dtype=torch.bool)
        kpm[0, -1] = True
        return dict(attn_mask=causal, key_padding_mask=kpm)

    def forward(self, x):
        q, k, v = self.qkv(x)
        if not self.batch_first:
            same = q is k and k is v
            q = q.transpose(0, 1)
            k, v = (q, q) if same else (k.transpose(0, 1), v.transpose(0, 1))
        h = self.attn(q, k, v, need_weights=self.need_weights, **self.mask_args(x))[0]
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(dim=1))


class _LinearAttention(nn.Module):
    """The same attention written with nn.Linear layers and F.scaled_dot_product_attention."""

    def __init__(self, mha: nn.MultiheadAttention, fused: bool):
        super().__init__()
        e, b = mha.embed_dim, mha.in_proj_bias is not None
        self.h, self.e, self.fused = mha.num_heads, e, fused
        with torch.no_grad():
            if fused:
                self.qkv = nn.Linear(e, 3 * e, bias=b).double()
                self.qkv.weight.copy_(mha.in_proj_weight)
                if b:
                    self.qkv.bias.copy_(mha.in_proj_bias)
            else:
                ws = ((mha.in_proj_weight[:e], mha.in_proj_weight[e:2 * e],
                       mha.in_proj_weight[2 * e:]) if mha._qkv_same_embed_dim else
                      (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight))
                for j, (nm, w) in enumerate(zip(("q", "k", "v"), ws, strict=True)):
                    lin = nn.Linear(w.shape[1], e, bias=b).double()
                    lin.weight.copy_(w)
                    if b:
                        lin.bias.copy_(mha.in_proj_bias[j * e:(j + 1) * e])
                    setattr(self, nm, lin)
            self.out = nn.Linear(e, e, bias=mha.out_proj.bias is not None).double()
            self.out.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out.bias.copy_(mha.out_proj.bias)

    def forward(self, q, k, v, attn_mask=None, key_padding_mask=None, **_):
        if self.fused:
            q, k, v = self.qkv(q).split(self.e, dim=-1)
        else:
            q, k, v = self.q(q), self.k(k), self.v(v)
        n, hd = q.shape[0], self.e // self.h
        q, k, v = (t.reshape(n, -1, self.h, hd).transpose(1, 2) for t in (q, k, v))
        allowed = None
        if attn_mask is not None or key_padding_mask is not None:
            allowed = torch.ones(n, 1, q.shape[2], k.shape[2], dtype=torch.bool)
            if attn_mask is not None:
                allowed = allowed & ~attn_mask
            if key_padding_mask is not None:
                allowed = allowed & ~key_padding_mask[:, None, None, :]
        c = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return (self.out(c.transpose(1, 2).reshape(n, -1, self.e)), None)


def _linear_twin(net):
    """``net`` with its attention replaced by :class:`_LinearAttention` (batch first)."""
    import copy

    twin = copy.deepcopy(net)
    fused = not net.cross and net.attn._qkv_same_embed_dim
    twin.attn = _LinearAttention(net.attn, fused)
    twin.batch_first = True
    return twin


MHA_CASES = {
    "self": dict(),
    "self_seq_first": dict(batch_first=False),
    "self_no_bias_masks": dict(bias=False, masks=True),
    "self_no_weights": dict(need_weights=False, masks=True),
    "cross": dict(cross=True),
    "cross_seq_first_masks": dict(cross=True, batch_first=False, masks=True),
    "cross_kdim": dict(cross=True, kdim=5),
    "cross_kdim_no_bias": dict(cross=True, kdim=5, bias=False),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_mha_equals_the_same_attention_written_with_linears(case, sharing):
    torch.manual_seed(1)
    net = _MHANet(**MHA_CASES[case]).double().eval()
    x = torch.randn(5, L, E, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (5,))
    twin = _linear_twin(net)
    with torch.no_grad():
        assert torch.allclose(net(x), twin(x), rtol=1e-12, atol=1e-12)
    ref = reference_torch_kfac(net, "cross_entropy", x, y, sharing=sharing)
    oracle = reference_torch_kfac(twin, "cross_entropy", x, y, sharing=sharing)
    if net.cross or not net.attn._qkv_same_embed_dim:
        pairs = {f"attn.{p}_proj": f"attn.{p}" for p in "qkv"}
        assert "attn.in_proj" not in ref
    else:
        pairs = {"attn.in_proj": "attn.qkv"}
        assert not any(f"attn.{p}_proj" in ref for p in "qkv")
    pairs["attn.out_proj"] = "attn.out"
    pairs["head"] = "head"
    expand = reference_torch_kfac(net, "cross_entropy", x, y)
    for mine, theirs in pairs.items():
        for fac in ("A", "G"):
            if (mine, fac, sharing) == ("attn.k_proj", "G", "reduce"):
                # the scores are invariant to a shift of all keys: Σ_s ∂ℓ/∂k_s = 0, so the
                # reduce G of the key projection is rounding noise in both
                size = np.linalg.norm(expand[mine]["G"])
                assert np.linalg.norm(ref[mine]["G"]) <= 1e-12 * size
                assert np.linalg.norm(oracle[theirs]["G"]) <= 1e-12 * size
                continue
            _agree(ref[mine][fac], oracle[theirs][fac])
        assert ref[mine]["kind"] == "dense" and ref[mine]["uses"] == 1
        assert ref[mine]["T"] == oracle[theirs]["T"]
        assert ref[mine]["bias"] == oracle[theirs]["bias"]
    assert ref["attn.k_proj" if net.cross else "attn.out_proj"]["T"] == (S if net.cross else L)
    # the model is left as it was: no hook, the same output
    with torch.no_grad():
        assert torch.equal(net(x), net(x)) and not net.attn._forward_hooks


def test_mha_blocks_equal_the_per_example_fisher_at_one_location():
    """N = 1, one position: A ⊗ G of in_proj and out_proj is the exact Fisher block of the
    squared error, from autograd parameter gradients."""
    torch.manual_seed(2)
    net = _MHANet().double().eval()
    x = torch.randn(1, 1, E, dtype=torch.float64)
    y = torch.randn(1, CLASSES, dtype=torch.float64)
    ref = reference_torch_kfac(net, "mse", x, y)
    a = net.attn
    for name, w, b in (("attn.in_proj", a.in_proj_weight, a.in_proj_bias),
                       ("attn.out_proj", a.out_proj.weight, a.out_proj.bias)):
        # parameters [W | b] row-major: the per-example gradient of W and b, interleaved
        fisher = _per_example_fisher_wb(net, x, w, b, CLASSES)
        _agree(_kron_block(ref[name]), fisher)
        assert _rel(np.kron(ref[name]["A"], ref[name]["G"]), fisher) > 1e-3


def _per_example_fisher_wb(model, x, w, b, n_out):
    """:func:`_per_example_fisher` over the row-major ``[W | b]`` (``[out, in+1]``)."""
    out = model(x)
    rows = []
    for k in range(n_out):
        gw, gb = torch.autograd.grad(out[0, k], [w, b], retain_graph=True)
        rows.append(torch.cat([gw, gb[:, None]], dim=1).reshape(-1))
    d = torch.stack(rows).detach().numpy()
    return d.T @ d


def test_mha_refuses_training_dropout_and_unsupported_options():
    torch.manual_seed(0)
    x, y = torch.randn(3, L, E, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    net = _MHANet().double()
    net.attn.dropout = 0.1
    net.train()
    with pytest.raises(ValueError, match=r"nn.MultiheadAttention 'attn' must not drop out: "
                                         r"call model.eval\(\) or set dropout=0"):
        reference_torch_kfac(net, "cross_entropy", x, y)
    net.eval()  # eval mode: dropout is off, the reference runs
    assert "attn.in_proj" in reference_torch_kfac(net, "cross_entropy", x, y)
    bad = _MHANet().double()
    bad.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, add_bias_kv=True).double()
    with pytest.raises(ValueError, match=r"nn.MultiheadAttention 'attn' must have "
                                         r"add_bias_kv=False and add_zero_attn=False"):
        reference_torch_kfac(bad, "cross_entropy", x, y)


# -- a hand-written K-FAC of nn.Linear layers (independent of the conformance code) --------

def _loss_vectors(out, loss, y=None, mode="fisher_exact"):
    """Per-example output-space vectors v_k [N, C] with Σ_k v vᵀ the per-example curvature:
    the identity columns for ½‖f − y‖², sqrt(p_k)(e_k − p) for the softmax cross-entropy,
    the label gradient for the empirical Fisher."""
    n, c = out.shape
    eye = torch.eye(c, dtype=out.dtype)
    if loss == "mse":
        return [eye[k].expand(n, c) for k in range(c)]
    p = torch.softmax(out.detach(), dim=1)
    if mode == "fisher_empirical":
        return [p - F.one_hot(y, c).to(p.dtype)]
    return [p[:, k:k + 1].sqrt() * (eye[k] - p) for k in range(c)]


def _hand_kfac(model, x, y, loss, names, *, sharing="expand", mode="fisher_exact"):
    """K-FAC of the nn.Linear layers ``names`` of ``model``, by hooks and einsum: every call
    of a layer is one more use; rows [N, U·S, d] with the bias's 1 last."""
    mods = dict(model.named_modules())
    calls = {nm: [] for nm in names}
    hooks = [mods[nm].register_forward_hook(
        lambda m, i, o, nm=nm: calls[nm].append((i[0].detach(), o))) for nm in names]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    n = out.shape[0]
    sites = [o for nm in names for _, o in calls[nm]]
    gs = [torch.autograd.grad(out, sites, v, retain_graph=True)
          for v in _loss_vectors(out, loss, y, mode)]
    factors, j = {}, 0
    for nm in names:
        u = len(calls[nm])
        a = torch.cat([i.reshape(n, -1, i.shape[-1]) for i, _ in calls[nm]], dim=1)
        if mods[nm].bias is not None:
            a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype)], dim=2)
        g = torch.stack([torch.cat([gk[j + q].reshape(n, -1, gk[j + q].shape[-1])
                                    for q in range(u)], dim=1) for gk in gs])  # [K, N, P, o]
        j += u
        if sharing == "expand":
            fa = torch.einsum("npi,npj->ij", a, a) / (a.shape[0] * a.shape[1])
            fg = torch.einsum("knpi,knpj->ij", g, g) / n
        else:
            am, gsum = a.mean(dim=1), g.sum(dim=2)
            fa = am.T @ am / n
            fg = torch.einsum("kni,knj->ij", gsum, gsum) / n
        factors[nm] = {"A": fa.detach(), "G": fg.detach()}
    return factors


def _layers_kw(names):
    """``layers=`` for check_torch_kfac where it has the parameter (the checker being
    rewritten asks for every supported layer unless a subset is named)."""
    if "layers" in inspect.signature(check_torch_kfac).parameters:
        return {"layers": list(names)}
    return {}


# -- modules called several times; residual graphs ---------------------------------------

class _Twice(nn.Module):
    """One Linear (or Conv2d) applied twice, with a residual; or two copies of it."""

    def __init__(self, conv=False, copies=False, seq=False):
        super().__init__()
        self.f = nn.Conv2d(3, 3, 3, padding=1) if conv else nn.Linear(4, 4)
        if copies:
            self.f2 = nn.Conv2d(3, 3, 3, padding=1) if conv else nn.Linear(4, 4)
            self.f2.load_state_dict(self.f.state_dict())
        self.copies, self.conv, self.seq = copies, conv, seq
        self.head = nn.Linear(3 * 4 * 4 if conv else 4, 3)

    def forward(self, x):
        h = torch.tanh(self.f(x))
        h = h + (self.f2 if self.copies else self.f)(h)  # residual
        if self.seq:
            h = h.mean(dim=1)
        return self.head(h.reshape(len(h), -1))


@pytest.mark.parametrize("conv", [False, True])
def test_a_module_called_twice_is_two_copies_pooled(conv):
    """KFAC-expand of U uses: A over all (use, location) rows = the mean of the copies' A,
    G = the sum of the copies' G."""
    torch.manual_seed(3)
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64) if conv else \
        torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    net = _Twice(conv).double()
    twin = _Twice(conv, copies=True).double()
    twin.load_state_dict({**net.state_dict(),
                          **{k.replace("f.", "f2."): v for k, v in net.state_dict().items()
                             if k.startswith("f.")}})
    ref = reference_torch_kfac(net, "cross_entropy", x, y)["f"]
    two = reference_torch_kfac(twin, "cross_entropy", x, y)
    assert ref["uses"] == 1 + 1 and two["f"]["uses"] == 1 and ref["groups"] == 1
    assert ref["T"] == (16 if conv else 1) and ref["kind"] == ("conv2d" if conv else "dense")
    _agree(ref["A"], (two["f"]["A"] + two["f2"]["A"]) / 2)
    _agree(ref["G"], two["f"]["G"] + two["f2"]["G"])
    assert "_x" not in ref  # the data of a single call only


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("seq", [False, True])
def test_uses_and_residuals_match_a_hand_written_kfac(sharing, seq):
    torch.manual_seed(4)
    net = _Twice(seq=seq).double()
    x = torch.randn(5, *((3, 4) if seq else (4,)), dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    ref = reference_torch_kfac(net, "cross_entropy", x, y, sharing=sharing)
    mine = _hand_kfac(net, x, y, "cross_entropy", ["f", "head"], sharing=sharing)
    for nm in ("f", "head"):
        for fac in ("A", "G"):
            _agree(ref[nm][fac], mine[nm][fac].numpy())
    assert ref["f"]["uses"] == 2 and ref["head"]["uses"] == 1
    assert ref["f"]["T"] == (3 if seq else 1)
    if sharing == "expand" or not seq:
        res = check_torch_kfac(net, "cross_entropy", x, y, mine, sharing=sharing,
                               **_layers_kw(mine))
        assert res.ok, str(res)
    # reduce differs from expand for a module used twice, even without positions
    other = reference_torch_kfac(net, "cross_entropy", x, y,
                                 sharing="reduce" if sharing == "expand" else "expand")
    assert _rel(other["f"]["A"], ref["f"]["A"]) > 1e-3


def test_residual_mlp_passes_and_a_planted_bug_is_named():
    torch.manual_seed(5)
    net = _Twice(copies=True).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    names = ["f", "f2", "head"]
    mine = _hand_kfac(net, x, y, "cross_entropy", names)
    res = check_torch_kfac(net, "cross_entropy", x, y, mine, **_layers_kw(names))
    assert res.ok, str(res)
    mine["f2"]["G"] = mine["f2"]["G"] / 49  # the mean loss's gradients: 1/N²
    res = check_torch_kfac(net, "cross_entropy", x, y, mine, **_layers_kw(names))
    bad = {(c.layer, c.factor) for c in res.checks if not c.ok}
    assert not res.ok and bad <= {("f2", "G"), ("f2", "block")}, str(res)
    assert any(c.layer == "f2" and "1/N" in c.diagnosis for c in res.checks if not c.ok)


# -- scale-and-shift: LayerNorm, BatchNorm, GroupNorm affine ------------------------------

def _per_example_param_fisher(model, x, names):
    """F = (1/N) Σ_{n,k} u_{n,k} u_{n,k}ᵀ of the squared error (Fisher factor I): u_{n,k} the
    per-example gradient of output k w.r.t. the parameters ``names`` (concatenated in that
    order, each row-major), by torch.func.vmap(jacrev) — the exact Fisher block."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def f(p, xi):
        return torch.func.functional_call(model, (p, buffers), (xi[None],))[0]

    jac = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))(params, x)
    n, c = x.shape[0], jac[names[0]].shape[1]
    u = torch.cat([jac[nm].reshape(n, c, -1) for nm in names], dim=2)
    return (torch.einsum("nkp,nkq->pq", u, u) / n).numpy()


class _NormNet(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind.startswith("layernorm"):
            self.pre = nn.Linear(3, 4)
            shape = (5, 4) if kind == "layernorm_2d" else 4
            self.norm = nn.LayerNorm(shape, bias=kind != "layernorm_no_bias")
            self.head = nn.Linear(4, 3)
        elif kind == "batchnorm1d_flat":
            self.pre, self.norm, self.head = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)
        elif kind == "batchnorm1d_seq":
            self.pre = nn.Conv1d(2, 4, 3, padding=1)
            self.norm, self.head = nn.BatchNorm1d(4), nn.Linear(4 * 5, 3)
        else:
            self.pre = nn.Conv2d(2, 4, 3, padding=1)
            self.norm = nn.BatchNorm2d(4) if kind == "batchnorm2d" else nn.GroupNorm(2, 4)
            self.head = nn.Linear(4 * 3 * 3, 3)
        with torch.no_grad():  # a scale and shift that are not the initial 1 and 0, one γ 0
            self.norm.weight.copy_(torch.randn_like(self.norm.weight))
            self.norm.weight.view(-1)[1] = 0.0
            if self.norm.bias is not None:
                self.norm.bias.copy_(torch.randn_like(self.norm.bias))
            if isinstance(self.norm, nn.modules.batchnorm._BatchNorm):
                self.norm.running_mean.copy_(torch.randn(4))
                self.norm.running_var.copy_(torch.rand(4) + 0.5)

    def forward(self, x):
        h = torch.tanh(self.norm(self.pre(x)))
        if self.kind.startswith("layernorm"):
            h = h.mean(dim=1)
        return self.head(h.reshape(len(h), -1))


NORM_INPUTS = {"layernorm": (5, 3), "layernorm_2d": (5, 3), "layernorm_no_bias": (5, 3),
               "batchnorm1d_flat": (3,), "batchnorm1d_seq": (2, 5),
               "batchnorm2d": (2, 3, 3), "groupnorm": (2, 3, 3)}


@pytest.mark.parametrize("kind", list(NORM_INPUTS))
def test_scale_shift_is_the_per_example_fisher_of_gamma_and_beta(kind):
    torch.manual_seed(6)
    net = _NormNet(kind).double().eval()
    x = torch.randn(6, *NORM_INPUTS[kind], dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    ref = reference_torch_kfac(net, "mse", x, y)
    e = ref["norm"]
    names = ["norm.weight"] + (["norm.bias"] if net.norm.bias is not None else [])
    oracle = _per_example_param_fisher(net, x, names)
    _agree(e["F"], oracle)
    _agree(e["diag"], np.diag(oracle))
    q = net.norm.weight.numel()
    assert e["F"].shape == (len(names) * q,) * 2 and "A" not in e and "G" not in e
    assert e["kind"] == "scale_shift" and e["bias"] == (len(names) == 2)
    t = {"layernorm": 5, "layernorm_no_bias": 5, "layernorm_2d": 1, "batchnorm1d_flat": 1,
         "batchnorm1d_seq": 5}.get(kind, 9)
    assert e["T"] == t and e["uses"] == 1 and e["K"] == 3
    # the reduce reference of a scale-and-shift layer is the same (it is exact, not Kronecker)
    _agree(reference_torch_kfac(net, "mse", x, y, sharing="reduce")["norm"]["F"], oracle)


def test_train_mode_batchnorm_uses_batch_statistics_and_keeps_running_stats():
    """Training mode: x̂ from the batch's statistics, the per-example vectors are the rows of
    one backward pass of the batch (what hook-based optimisers see).  BatchNorm's own (γ, β)
    block equals that of an eval-mode copy whose running statistics are the batch's; a layer
    *before* it sees the coupling of the examples through the batch statistics."""
    torch.manual_seed(7)
    net = _NormNet("batchnorm2d").double().train()
    x = torch.randn(6, 2, 3, 3, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ref = reference_torch_kfac(net, "mse", x, y)
    for k, v in net.state_dict().items():  # running statistics restored
        assert torch.equal(v, before[k]), k
    import copy

    frozen = copy.deepcopy(net).eval()
    with torch.no_grad():
        h = net.pre(x)
        frozen.norm.running_mean.copy_(h.mean(dim=(0, 2, 3)))
        frozen.norm.running_var.copy_(h.var(dim=(0, 2, 3), unbiased=False))
    fr = reference_torch_kfac(frozen, "mse", x, y)
    _agree(ref["norm"]["F"], fr["norm"]["F"])
    _agree(ref["head"]["G"], fr["head"]["G"])
    _agree(ref["pre"]["A"], fr["pre"]["A"])
    assert _rel(ref["pre"]["G"], fr["pre"]["G"]) > 1e-3  # coupled through the batch statistics


def test_a_norm_layer_called_twice_sums_its_uses():
    """u_{n,k} sums over every position sharing γ, β: both calls of one LayerNorm."""
    torch.manual_seed(8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)
            with torch.no_grad():
                self.norm.weight.copy_(torch.randn(4))
                self.norm.bias.copy_(torch.randn(4))

        def forward(self, x):
            return self.head(self.norm(torch.tanh(self.mid(self.norm(x)))))

    net = Net().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    e = reference_torch_kfac(net, "mse", x, y)["norm"]
    assert e["uses"] == 2 and e["T"] == 1
    _agree(e["F"], _per_example_param_fisher(net, x, ["norm.weight", "norm.bias"]))


# -- nn.Embedding ---------------------------------------------------------------------------

class _EmbNet(nn.Module):
    def __init__(self, vocab=7, dim=3, padding_idx=None, seq=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, 3)
        self.seq = seq

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        return self.head(h.mean(dim=1) if self.seq else h)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_block_is_the_per_example_fisher_for_one_id(padding_idx):
    """N = 1, one id: A ⊗ G is the exact Fisher block of the table (row-major [V, D]),
    zero for the padding row (PyTorch gives it no gradient)."""
    torch.manual_seed(9)
    net = _EmbNet(padding_idx=padding_idx, seq=False).double()
    y = torch.randn(1, 3, dtype=torch.float64)
    for i in (2, 4):
        ids = torch.tensor([i])
        e = reference_torch_kfac(net, "mse", ids, y)["emb"]
        fisher = _per_example_fisher(net, ids, [net.emb.weight], 3)
        block = np.kron(e["A"], e["G"])
        if i == padding_idx:
            assert np.abs(fisher).max() == 0 and np.abs(block).max() == 0
            continue
        _agree(block, fisher)
        assert e["A_diagonal"] and e["A"].shape == (7, 7) and e["G"].shape == (3, 3)


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_embedding_counts_and_vectors_by_hand(sharing, padding_idx):
    torch.manual_seed(10)
    net = _EmbNet(padding_idx=padding_idx).double()
    ids = torch.randint(0, 7, (6, 4))
    ids[0, :2] = 0
    y = torch.randint(0, 3, (6,))
    e = reference_torch_kfac(net, "cross_entropy", ids, y, sharing=sharing)["emb"]
    assert e["kind"] == "embedding" and e["T"] == 4 and e["padding_idx"] == padding_idx
    n, s = ids.shape
    mine = _hand_kfac(_EmbAsLinear(net), F.one_hot(ids, 7).double(), y, "cross_entropy",
                      ["emb"], sharing=sharing)["emb"]
    if sharing == "expand":
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=7).astype(float)
        if padding_idx is not None:
            counts[padding_idx] = 0
        assert e["A_diagonal"]
        _agree(e["A"], np.diag(counts / (n * s)))
    else:
        m = np.stack([np.bincount(r, minlength=7) / s for r in ids.numpy()])  # per example
        if padding_idx is not None:
            m[:, padding_idx] = 0
        assert not e["A_diagonal"]
        _agree(e["A"], m.T @ m / n)
    if padding_idx is None:  # the one-hot Linear has the padding row's input too
        _agree(e["A"], mine["A"].numpy())
    _agree(e["G"], mine["G"].numpy())


class _EmbAsLinear(nn.Module):
    """The embedding net with onehot(ids) @ W as an nn.Linear (the same weights)."""

    def __init__(self, net):
        super().__init__()
        self.emb = nn.Linear(net.emb.num_embeddings, net.emb.embedding_dim, bias=False).double()
        with torch.no_grad():
            self.emb.weight.copy_(net.emb.weight.T)
        self.head, self.seq = net.head, net.seq

    def forward(self, onehot):
        h = torch.tanh(self.emb(onehot))
        return self.head(h.mean(dim=1) if self.seq else h)


def test_embedding_options_that_change_the_layer_are_refused():
    ids, y = torch.randint(0, 7, (3, 4)), torch.randint(0, 3, (3,))
    for kw in (dict(scale_grad_by_freq=True), dict(max_norm=1.0)):
        net = _EmbNet().double()
        net.emb = nn.Embedding(7, 3, **kw).double()
        with pytest.raises(ValueError, match=r"nn.Embedding 'emb' must have max_norm=None "
                                             r"and scale_grad_by_freq=False"):
            reference_torch_kfac(net, "cross_entropy", ids, y)


# -- Conv1d, Conv3d, grouped convolutions ---------------------------------------------------

class _ConvNet(nn.Module):
    def __init__(self, conv, out_shape, classes=3):
        super().__init__()
        self.conv = conv
        self.head = nn.Linear(int(np.prod(out_shape)), classes)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).reshape(len(x), -1))


class _Conv1dAs2d(nn.Module):
    """A Conv1d run as the Conv2d of kernel (1, k) on [N, C, 1, L] (the same weights)."""

    def __init__(self, net):
        super().__init__()
        c = net.conv
        pad = c.padding if isinstance(c.padding, str) else (0, c.padding[0])
        self.conv = nn.Conv2d(c.in_channels, c.out_channels, (1, c.kernel_size[0]),
                              stride=(1, c.stride[0]), padding=pad,
                              dilation=(1, c.dilation[0]), bias=c.bias is not None).double()
        with torch.no_grad():
            self.conv.weight.copy_(c.weight[:, :, None])
            if c.bias is not None:
                self.conv.bias.copy_(c.bias)
        self.head = net.head

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x[:, :, None])).reshape(len(x), -1))


CONV1D = {"plain": dict(kernel_size=3),
          "pad_stride_dil": dict(kernel_size=3, padding=2, stride=2, dilation=2),
          "same_even": dict(kernel_size=4, padding="same", bias=False),
          "valid": dict(kernel_size=2, padding="valid")}


def _out_shape(conv, x):
    with torch.no_grad():
        return conv(x).shape[1:]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(CONV1D))
def test_conv1d_is_conv2d_with_height_one(case, sharing):
    torch.manual_seed(11)
    x, y = torch.randn(4, 2, 9, dtype=torch.float64), torch.randint(0, 3, (4,))
    conv = nn.Conv1d(2, 3, **CONV1D[case]).double()
    net = _ConvNet(conv, _out_shape(conv, x)).double()
    ref = reference_torch_kfac(net, "cross_entropy", x, y, sharing=sharing)["conv"]
    two = reference_torch_kfac(_Conv1dAs2d(net), "cross_entropy", x, y,
                               sharing=sharing)["conv"]
    assert ref["kind"] == "conv1d" and two["kind"] == "conv2d" and ref["T"] == two["T"]
    _agree(ref["A"], two["A"])
    _agree(ref["G"], two["G"])
    assert ref["kernel"] == [CONV1D[case]["kernel_size"]] and ref["groups"] == 1


def _loop_patches(x, kernel, padding, stride, dilation):
    """[N, T, C·|Δ|] patches by explicit loops over examples, locations, channels, offsets
    (channel slowest, then the offsets row-major): the test's own oracle."""
    n, c = x.shape[:2]
    xp = np.pad(x, [(0, 0), (0, 0)] + list(padding))
    sp = xp.shape[2:]
    outs = [(sp[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
            for i in range(len(kernel))]
    rows = np.zeros((n, int(np.prod(outs)), c * int(np.prod(kernel))))
    for ni in range(n):
        for ti, loc in enumerate(np.ndindex(*outs)):
            j = 0
            for ci in range(c):
                for off in np.ndindex(*kernel):
                    idx = tuple(loc[i] * stride[i] + off[i] * dilation[i]
                                for i in range(len(kernel)))
                    rows[ni, ti, j] = xp[(ni, ci) + idx]
                    j += 1
    return rows


def _hand_conv_g(net, x, y, loss):
    """[K, N, T, O] output vectors of ``net.conv`` by hooks and autograd."""
    keep = {}
    h = net.conv.register_forward_hook(lambda m, i, o: keep.setdefault("o", o))
    out = net(x)
    h.remove()
    gs = [torch.autograd.grad(out, keep["o"], v, retain_graph=True)[0]
          for v in _loss_vectors(out, loss, y)]
    g = torch.stack(gs).detach().numpy()
    return g.reshape(*g.shape[:3], -1).transpose(0, 1, 3, 2)


CONV3D = {"plain": dict(kernel_size=2),
          "pad_stride_dil": dict(kernel_size=(2, 3, 2), padding=(1, 0, 1), stride=(1, 2, 1),
                                 dilation=(2, 1, 1)),
          "same": dict(kernel_size=(3, 2, 2), padding="same", bias=False)}


@pytest.mark.parametrize("case", list(CONV3D))
def test_conv3d_against_loop_patches(case):
    torch.manual_seed(12)
    x, y = torch.randn(3, 2, 4, 5, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    conv = nn.Conv3d(2, 3, **CONV3D[case]).double()
    net = _ConvNet(conv, _out_shape(conv, x)).double()
    e = reference_torch_kfac(net, "cross_entropy", x, y)["conv"]
    from conformance.own_model._torch import torch_conv_padding_nd

    pad = [(1, 1), (0, 1), (0, 1)] if case == "same" else \
        [(p, p) for p in conv.padding]  # PyTorch's split of 'same': the extra one after
    assert tuple(map(tuple, pad)) == torch_conv_padding_nd(conv)
    p = _loop_patches(x.numpy(), conv.kernel_size, pad, conv.stride, conv.dilation)
    with torch.no_grad():  # the loop patches are the convolution's: p Wᵀ (+ b) is its output
        o = conv(x).reshape(3, 3, -1).transpose(1, 2).numpy()
    lin = p @ conv.weight.detach().reshape(3, -1).numpy().T
    _agree(lin + (0 if conv.bias is None else conv.bias.detach().numpy()), o)
    if conv.bias is not None:
        p = np.concatenate([p, np.ones((*p.shape[:2], 1))], axis=2)
    n, t = p.shape[:2]
    g = _hand_conv_g(net, x, y, "cross_entropy")
    assert e["kind"] == "conv3d" and e["T"] == t and e["c_in"] == 2
    _agree(e["A"], np.einsum("ntd,nte->de", p, p) / (n * t))
    _agree(e["G"], np.einsum("kntd,knte->de", g, g) / n)
    red = reference_torch_kfac(net, "cross_entropy", x, y, sharing="reduce")["conv"]
    pm, gsum = p.mean(axis=1), g.sum(axis=2)
    _agree(red["A"], pm.T @ pm / n)
    _agree(red["G"], np.einsum("knd,kne->de", gsum, gsum) / n)


def test_conv3d_block_is_the_per_example_fisher_at_one_location():
    torch.manual_seed(13)
    conv = nn.Conv3d(2, 3, (2, 3, 2), dilation=(1, 1, 2)).double()
    x = torch.randn(1, 2, 2, 3, 3, dtype=torch.float64)  # one output location
    net = _ConvNet(conv, _out_shape(conv, x)).double()
    e = reference_torch_kfac(net, "mse", x, torch.randn(1, 3, dtype=torch.float64))["conv"]
    assert e["T"] == 1
    out = net(x)
    rows = []
    for k in range(3):
        gw, gb = torch.autograd.grad(out[0, k], [conv.weight, conv.bias], retain_graph=True)
        rows.append(torch.cat([gw.reshape(3, -1), gb[:, None]], dim=1).reshape(-1))
    d = torch.stack(rows).detach().numpy()
    _agree(np.kron(e["G"], e["A"]), d.T @ d)


class _SplitConv(nn.Module):
    """A grouped convolution as ``groups`` separate convolutions on channel slices."""

    def __init__(self, net, dim):
        super().__init__()
        c = net.conv
        g, ci, co = c.groups, c.in_channels // c.groups, c.out_channels // c.groups
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
        self.parts = nn.ModuleList()
        for j in range(g):
            p = cls(ci, co, c.kernel_size, stride=c.stride, padding=c.padding,
                    dilation=c.dilation, bias=c.bias is not None).double()
            with torch.no_grad():
                p.weight.copy_(c.weight[j * co:(j + 1) * co])
                if c.bias is not None:
                    p.bias.copy_(c.bias[j * co:(j + 1) * co])
            self.parts.append(p)
        self.ci, self.head = ci, net.head

    def forward(self, x):
        h = torch.cat([p(x[:, j * self.ci:(j + 1) * self.ci])
                       for j, p in enumerate(self.parts)], dim=1)
        return self.head(torch.tanh(h).reshape(len(x), -1))


GROUPED = {"conv2d_g2": (2, dict(in_channels=4, out_channels=6, groups=2)),
           "conv2d_depthwise": (2, dict(in_channels=3, out_channels=6, groups=3,
                                        padding="same", bias=False)),
           "conv1d_g2": (1, dict(in_channels=4, out_channels=4, groups=2, stride=2)),
           "conv3d_g2": (3, dict(in_channels=2, out_channels=4, groups=2, padding=1))}


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_conv_is_its_groups_as_separate_convs(case, sharing):
    torch.manual_seed(14)
    dim, kw = GROUPED[case]
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
    conv = cls(kernel_size=3 if dim < 3 else 2, **kw).double()
    x = torch.randn(3, kw["in_channels"], *((5,) * dim), dtype=torch.float64)
    y = torch.randint(0, 3, (3,))
    net = _ConvNet(conv, _out_shape(conv, x)).double()
    e = reference_torch_kfac(net, "cross_entropy", x, y, sharing=sharing)["conv"]
    split = reference_torch_kfac(_SplitConv(net, dim), "cross_entropy", x, y,
                                 sharing=sharing)
    g = kw["groups"]
    assert e["groups"] == g and e["A"].shape[0] == g and e["G"].shape[0] == g
    assert e["kind"] == f"conv{dim}d"
    d = kw["in_channels"] // g * (3 if dim < 3 else 2) ** dim + (conv.bias is not None)
    assert e["A"].shape[1:] == (d, d)
    assert e["G"].shape[1:] == (kw["out_channels"] // g,) * 2
    for j in range(g):
        _agree(e["A"][j], split[f"parts.{j}"]["A"])
        _agree(e["G"][j], split[f"parts.{j}"]["G"])


def test_conv_padding_modes_are_refused_naming_the_module():
    for cls, x in ((nn.Conv1d, torch.randn(2, 2, 6)), (nn.Conv3d, torch.randn(2, 2, 4, 4, 4))):
        conv = cls(2, 2, 3, padding=1, padding_mode="reflect").double()
        net = _ConvNet(conv, _out_shape(conv, x.double())).double()
        with pytest.raises(ValueError, match=rf"nn.{cls.__name__} 'conv' must have "
                                             r"padding_mode='zeros'; got 'reflect'"):
            reference_torch_kfac(net, "cross_entropy", x.double(), torch.tensor([0, 1]))


# -- the tutorial's small transformer -------------------------------------------------------

DENSE = {"attn.in_proj": "attn.qkv", "attn.out_proj": "attn.out", "ff1": "ff1", "ff2": "ff2",
         "head": "head"}


def _hand_transformer_kfac(model, ids, y, mode="fisher_exact"):
    """A hand-written K-FAC of the transformer's dense layers: the attention rewritten with
    nn.Linear layers (the same weights) and hooks on them; keys in the model's names."""
    import copy

    twin = copy.deepcopy(model)
    twin.attn = _LinearAttention(model.attn, fused=True)
    mine = _hand_kfac(twin, ids, y, "cross_entropy", list(DENSE.values()), mode=mode)
    return {name: mine[twin_name] for name, twin_name in DENSE.items()}


def test_tiny_transformer_hand_written_kfac_passes_and_a_planted_bug_is_named():
    from conformance.own_model.examples import tiny_transformer

    model = tiny_transformer()
    torch.manual_seed(15)
    ids, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))
    ref = reference_torch_kfac(model, "cross_entropy", ids, y)
    assert set(ref) == {"emb", "ln1", "ln2", *DENSE}
    mine = _hand_transformer_kfac(model, ids, y)
    for name in DENSE:
        for fac in ("A", "G"):
            _agree(ref[name][fac], mine[name][fac].numpy())
    res = check_torch_kfac(model, "cross_entropy", ids, y, mine, **_layers_kw(DENSE))
    assert res.ok, str(res)
    # the planted bug: in_proj's G from the gradients of the mean loss (1/N²)
    bad = {k: dict(v) for k, v in mine.items()}
    bad["attn.in_proj"]["G"] = bad["attn.in_proj"]["G"] / 36
    res = check_torch_kfac(model, "cross_entropy", ids, y, bad, **_layers_kw(DENSE))
    failed = [c for c in res.checks if not c.ok]
    assert not res.ok and failed and {c.layer for c in failed} == {"attn.in_proj"}, str(res)
    assert any("1/N" in c.diagnosis for c in failed), str(res)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_tiny_transformer_embedding_and_layernorm_against_oracles():
    from conformance.own_model.examples import tiny_transformer

    model = tiny_transformer(causal=True)
    torch.manual_seed(16)
    ids, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 3, dtype=torch.float64)
    ref = reference_torch_kfac(model, "mse", ids, y)
    for ln in ("ln1", "ln2"):
        _agree(ref[ln]["F"], _per_example_param_fisher(model, ids, [f"{ln}.weight",
                                                                     f"{ln}.bias"]))
    counts = np.bincount(ids.reshape(-1).numpy(), minlength=11) / ids.numel()
    _agree(ref["emb"]["A"], np.diag(counts))


def test_transformer_encoder_layer_is_checkable():
    """nn.TransformerEncoderLayer (eval mode: its dropouts off) calls its attention with
    need_weights=False and a mask: in_proj's A is the second moment of norm1's output."""
    torch.manual_seed(17)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True,
                                                    norm_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1],
                                                                  dtype=x.dtype)
            return self.head(self.layer(x, src_mask=mask, is_causal=True).mean(dim=1))

    net = Net().double().eval()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randint(0, 3, (3,))
    ref = reference_torch_kfac(net, "cross_entropy", x, y)
    assert set(ref) == {"layer.self_attn.in_proj", "layer.self_attn.out_proj", "layer.linear1",
                        "layer.linear2", "layer.norm1", "layer.norm2", "head"}
    with torch.no_grad():
        a = net.layer.norm1(x).reshape(-1, 8)
    a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], dim=1).numpy()
    _agree(ref["layer.self_attn.in_proj"]["A"], a.T @ a / len(a))
    net.train()
    with pytest.raises(ValueError, match=r"nn.MultiheadAttention 'layer.self_attn' must not "
                                         r"drop out"):
        reference_torch_kfac(net, "cross_entropy", x, y)


# -- errors and edge cases ------------------------------------------------------------------

def test_mha_three_dimensional_float_mask():
    """An additive float attn_mask [N·heads, L, S] is added to the scores of each head."""
    torch.manual_seed(18)
    net = _MHANet().double().eval()
    x, y = torch.randn(3, L, E, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    bias = torch.randn(3 * HEADS, L, L, dtype=torch.float64)

    def fwd(self, x):
        return self.head(self.attn(x, x, x, attn_mask=bias)[0].mean(dim=1))

    class Masked(_MHANet):
        forward = fwd

    class MaskedTwin(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.attn, self.head = _LinearAttention(net.attn, fused=True), net.head

        def forward(self, x):
            q, k, v = self.attn.qkv(x).split(E, dim=-1)
            q, k, v = (t.reshape(3, L, HEADS, -1).transpose(1, 2) for t in (q, k, v))
            c = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.reshape(3, HEADS, L, L))
            return self.head(self.attn.out(c.transpose(1, 2).reshape(3, L, E)).mean(dim=1))

    masked = Masked().double().eval()
    masked.load_state_dict(net.state_dict())
    ref = reference_torch_kfac(masked, "cross_entropy", x, y)
    oracle = reference_torch_kfac(MaskedTwin(masked), "cross_entropy", x, y)
    for mine, theirs in (("attn.in_proj", "attn.qkv"), ("attn.out_proj", "attn.out")):
        _agree(ref[mine]["G"], oracle[theirs]["G"])
        _agree(ref[mine]["A"], oracle[theirs]["A"])


def test_mha_recomputation_mismatch_and_unbatched_calls_are_named():
    torch.manual_seed(19)
    net = _MHANet().double().eval()
    x, y = torch.randn(3, L, E, dtype=torch.float64), torch.randint(0, CLASSES, (3,))
    h = net.attn.register_forward_hook(lambda m, i, o: (2 * o[0], o[1]))  # the user's hook
    with pytest.raises(ValueError, match=r"nn.MultiheadAttention 'attn': the reference's "
                                         r"recomputation of the attention does not match"):
        reference_torch_kfac(net, "cross_entropy", x, y)
    h.remove()

    class Unbatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, HEADS)
            self.head = nn.Linear(E, CLASSES)

        def forward(self, x):
            return self.head(self.attn(x[0], x[0], x[0])[0])

    with pytest.raises(ValueError, match=r"nn.MultiheadAttention 'attn' must be called on "
                                         r"batched inputs \(3-D\)"):
        reference_torch_kfac(Unbatched().double(), "cross_entropy", x, y[:4])


def test_sequence_first_linear_inputs_and_unsupported_models_are_named():
    torch.manual_seed(20)

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):  # x [N, S, 4] run as [S, N, 4] through fc
            return self.head(self.fc(x.transpose(0, 1)).mean(dim=0))

    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"the input of nn.Linear 'fc' must have the batch "
                                         r"axis first \(\[N, \.\.\.\] with N = 5"):
        reference_torch_kfac(SeqFirst().double(), "cross_entropy", x, y)
    with pytest.raises(ValueError, match=r"model must contain a K-FAC layer"):
        reference_torch_kfac(nn.Sequential(nn.Tanh()), "cross_entropy", x[:, 0, :3], y)


def test_unused_and_dead_layers():
    """A module never called has no entry; a layer whose output does not reach the loss has
    G = 0 (no gradient flows to it)."""
    torch.manual_seed(21)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.dead, self.spare = nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            self.dead(x)
            return self.fc(x)

    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    ref = reference_torch_kfac(Net().double(), "cross_entropy", x, y)
    assert set(ref) == {"fc", "dead"}
    assert np.abs(ref["dead"]["G"]).max() == 0 and np.abs(ref["dead"]["A"]).max() > 0


def test_float32_transformer_reference_keeps_the_models_dtype():
    from conformance.own_model.examples import tiny_transformer

    torch.manual_seed(22)
    ids, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 3, (4,))
    r32 = reference_torch_kfac(tiny_transformer(dtype=torch.float32), "cross_entropy", ids, y)
    r64 = reference_torch_kfac(tiny_transformer(), "cross_entropy", ids, y)
    for name, e in r32.items():
        assert e["dtype"] == "float32" and r64[name]["dtype"] == "float64"
        for key in ("A", "G", "F"):
            if key in e:
                assert _rel(e[key], r64[name][key]) < 1e-5, (name, key)


def test_attention_applied_twice_has_two_uses():
    torch.manual_seed(23)

    class Twice(nn.Module):
        def __init__(self, attn=None):
            super().__init__()
            self.attn = attn or nn.MultiheadAttention(E, HEADS, batch_first=True)
            self.head = nn.Linear(E, CLASSES)

        def forward(self, x):
            for _ in range(2):
                x = x + self.attn(x, x, x, need_weights=False)[0]
            return self.head(x.mean(dim=1))

    net = Twice().double().eval()
    twin = Twice(_LinearAttention(net.attn, fused=True)).double()
    twin.head.load_state_dict(net.head.state_dict())
    x, y = torch.randn(4, L, E, dtype=torch.float64), torch.randint(0, CLASSES, (4,))
    for sharing in ("expand", "reduce"):
        ref = reference_torch_kfac(net, "cross_entropy", x, y, sharing=sharing)
        oracle = reference_torch_kfac(twin, "cross_entropy", x, y, sharing=sharing)
        for mine, theirs in (("attn.in_proj", "attn.qkv"), ("attn.out_proj", "attn.out")):
            assert ref[mine]["uses"] == 2 and ref[mine]["T"] == L
            _agree(ref[mine]["A"], oracle[theirs]["A"])
            _agree(ref[mine]["G"], oracle[theirs]["G"])


def test_conv_called_twice_reduce_by_unfold():
    """KFAC-reduce of a Conv2d called twice: the mean patch over uses × locations (patches by
    torch's unfold) and the summed vectors, per example."""
    torch.manual_seed(24)
    net = _Twice(conv=True).double()
    x, y = torch.randn(5, 3, 4, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    e = reference_torch_kfac(net, "cross_entropy", x, y, sharing="reduce")["f"]
    calls = []
    h = net.f.register_forward_hook(lambda m, i, o: calls.append((i[0].detach(), o)))
    out = net(x)
    h.remove()
    p = torch.cat([F.unfold(i, 3, padding=1).transpose(1, 2) for i, _ in calls], dim=1)
    p = torch.cat([p, torch.ones(*p.shape[:2], 1, dtype=p.dtype)], dim=2).mean(dim=1)
    gs = [torch.autograd.grad(out, [o for _, o in calls], v, retain_graph=True)
          for v in _loss_vectors(out, "cross_entropy", y)]
    gsum = torch.stack([sum(g.sum(dim=(2, 3)) for g in gk) for gk in gs])  # [K, N, O]
    assert e["uses"] == 2 and e["T"] == 16
    _agree(e["A"], (p.T @ p / 5).numpy())
    _agree(e["G"], (torch.einsum("kni,knj->ij", gsum, gsum) / 5).numpy())

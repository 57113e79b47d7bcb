"""The lean batched step: our own forward over a loaded model's weights, for every family
with a `DecoderLayout`, with no transformers Python per token.

`forward_batch` / `stage_forward_batch` (batch_attention.py, parallel/rank_steps.py) call the
`LeanModel` attached to a model (`enable_lean_forward`, done at load) instead of the
transformers model. One step, over the plan's flattened rows `[T]`:

1. embed (the model's embedding module, which carries Gemma's `sqrt(hidden)` scale), the
   plan's `row_embeddings` (an image's projected vision features, unscaled as transformers'
   Gemma 3 merges them) replacing their rows; or take the previous pipeline rank's hidden
   states. Rows wider than the hidden size carry Qwen3-VL's deepstack features after the
   embedding (`PromptImage.embeddings`): the k-th is added to those rows after decoder
   layer k (such a step runs its layers one by one, never in exo's decode layer);
2. rotary cos/sin once per step (the model's rotary module, once per rope kind; Gemma 3
   has a local one for sliding layers), as whole-head tables (`direct_forward_parts.rotary_tables`);
   a step whose plan carries multimodal positions (Qwen2.5-VL and Qwen3-VL prompts with
   images: `BatchPlan.rotary_positions`) mixes the tables of its three position rows per
   frequency section, or interleaved (`direct_forward_parts.multimodal_rotary_tables`);
3. per decoder layer: RMSNorm (one `F.rms_norm` call, or exo's one-pass kernel where its
   int4 kernels run (`native_kernels`); Gemma's `1 + weight` folded into the weight at build
   time), ONE fused Q/K/V matmul, per-head q/k norms (Qwen3, Gemma 3) and
   rotary over queries and keys together, `batch_attention.attend` (slot KV cache, per-request
   positions and windows), the output projection (all-reduced on tensor ranks), Gemma 3's
   post-attention norm, the residual add in place; then the same for the MLP with ONE fused
   gate/up matmul and the activation times up (where exo's kernels run, the q/k norms with
   the rotary and the activation with its product are one C++ pass each:
   `exo_native.qk_norm_rotary`, `exo_native.gated_activation`);
4. on the last rank: the final norm and LM head on the logit rows only (Gemma's final logit
   soft-capping where configured).

A decode-only step (no prefill rows) where exo's kernels run (`native_kernels`, AVX2 CPUs)
runs step 3 as one C++ call per layer instead (`native/decode_layer.cpp`: the same
operations on the same weights, over the decode rows and their slots), when every layer's
projections are held in a form it reads (exo's int4 / int8 blocks, int8 per channel,
bfloat16 or float32 dense; on a tensor rank in three calls around the two all-reduces).
The operators' Python and dispatch were half a decode step on a small model (figures:
docs/benchmarks/engine-design-figures.md#direct_forwardpy).

A step of prompt rows only sets `quantized_linear.PROMPT_PRODUCT` (block weights take the
integer GEMM at any row count), and where exo's kernels run each prompt chunk's last row
attends by its row kernel (`batch_attention.last_row_attention`): a prompt's last row then
comes out the same bits at the end of a cold prefill's chunk and alone after a prefix-cache
hit, so a seeded request gives the same text both ways (`tests/test_seeded_paths.py`).

Dtypes: the residual stream stays float32. With quantized linears on a CPU with native
bfloat16 (`direct_forward_parts.bf16_activations_wanted`), a norm's output is cast to bfloat16 once
and the int4/int8 kernels take and give bfloat16 directly (the MLP stays bfloat16 from the
gate/up matmul to the down matmul); attention runs in float32, the KV cache storing its keys
and values in bfloat16 (the default on CPU: rounded on store, widened on load) or float32
(`--kv-cache-dtype`; exo's decode layer reads either). Without
native bfloat16 every activation is float32 and the quantized modules cast around their kernel
(what they did before), except exo's own int4 kernel (AVX2 CPUs), which takes float32
rows. Fusing Q/K/V and gate/up follows gpt-fast (`wqkv`, `w1`/`w3`) and vLLM
(`QKVParallelLinear`, `MergedColumnParallelLinear`); on a tensor rank the rank's slices are
fused, after the split.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from exo.worker.engines.torch.batching.batch_attention import BatchPlan, attach_lean_step, attend
from exo.worker.engines.torch.comm.parallel_linears import VocabParallelHead
from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.direct_forward_layer import LeanLayer
from exo.worker.engines.torch.model.direct_forward_parts import (
    LeanUnsupportedError,
    Projection,
    RotaryCache,
    RotaryTables,
    bf16_activations_wanted,
    multimodal_rotary_tables,
    norm_weight,
    rotary_tables,
    static_rope,
)
from exo.worker.engines.torch.model.families import ModelFamily, UnsupportedArchitectureError
from exo.worker.engines.torch.model.sharding import AbsentModule
from exo.worker.engines.torch.quant.native_kernels import bf16_prefill_available, native_int4_kernel
from exo.worker.engines.torch.quant.quantized_linear import PROMPT_PRODUCT, QuantizedLinear

# "0": keep transformers' forward on the serving path (for A/B measurements and debugging).
LEAN_ENV = "EXO_LEAN_FORWARD"
# "0": decode steps run the lean forward's torch operators instead of exo's decode layer.
NATIVE_DECODE_ENV = "EXO_NATIVE_DECODE"
# The attribute of `model.model` holding the global index of its first decoder layer, set
# where a pipeline stage keeps only some (`parallel/pipeline.py`); absent: 0.
FIRST_LAYER_ATTRIBUTE = "exo_first_layer"


class LeanModel:
    """A loaded (possibly sharded) model's batched step without transformers' forward.

    Args:
        model: the loaded causal LM (whole, a pipeline stage, or a tensor rank's slices).
        family: its family file (with a `layout`).
        bf16: bfloat16 activations around quantized kernels (None: where the CPU has native
            bfloat16 and some decoder linear is quantized).

    Raises:
        LeanUnsupportedError: a part the lean forward has no code for (the caller keeps
            transformers' forward).
    """

    enabled: bool

    def __init__(self, model: nn.Module, family: ModelFamily, bf16: bool | None = None) -> None:
        if family.layout is None:
            raise LeanUnsupportedError(f"the {family.name} family has no decoder layout")
        inner: Any = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise LeanUnsupportedError("no decoder layers at model.model.layers")
        quantized = any(isinstance(module, QuantizedLinear) for module in layers.modules())
        self.bf16 = (bf16_activations_wanted() if bf16 is None else bf16) and quantized
        # With exo's int4 kernels in use, its one-pass RMSNorm too (`native_kernels`).
        self._native_norm: Any = None
        # exo's act(gate) * up and q/k norm + rotary for prefill, where its kernels run.
        self._gated_activation: Any = None
        self._qk_norm_rotary: Any = None
        if any(getattr(module, "native", False) for module in layers.modules()):
            self._native_norm = torch.ops.exo_native.rms_norm
            self._gated_activation = torch.ops.exo_native.gated_activation
            self._qk_norm_rotary = torch.ops.exo_native.qk_norm_rotary
        self.enabled = True
        config: Any = model.config
        text_config: Any = config.get_text_config()
        self._rotary: nn.Module = inner.rotary_emb
        self._per_frequency = family.layout.rotary_per_frequency
        layer_types = getattr(text_config, "layer_types", None)
        if family.layout.rope_per_layer_type and isinstance(layer_types, list | tuple):
            self._rope_kinds: list[str | None] = sorted(set(layer_types))
            ropes = [self._rope_kinds.index(kind) for kind in layer_types]
        else:
            self._rope_kinds = [None]
            ropes = [0] * len(layers)
        self.layers = [
            LeanLayer(layer, family, self.bf16, rope, text_config)
            for layer, rope in zip(layers, ropes, strict=True)
        ]
        # Qwen2.5-VL's / Qwen3-VL's frequencies per multimodal position row (None: 1-D
        # rotary only); Qwen3-VL's interleave the rows (`mrope_interleaved`).
        rope_parameters = getattr(text_config, "rope_parameters", None) or {}
        sections = rope_parameters.get("mrope_section")
        self._mrope_section: list[int] | None = list(sections) if sections else None
        self._mrope_interleaved = bool(rope_parameters.get("mrope_interleaved", False))
        self._rotary_cache: RotaryCache | None = None
        if static_rope(self._rotary, self._rope_kinds):
            self._rotary_cache = RotaryCache(self._computed_rotary_tables)
        self._embedding: nn.Module | None = inner.embed_tokens
        if isinstance(self._embedding, AbsentModule):
            self._embedding = None
        self._hidden_size = int(text_config.hidden_size)
        # The global index of this model's first decoder layer (a later pipeline rank's is
        # its stage's first: Qwen3-VL's deepstack feature k goes after global layer k).
        self._first_layer = int(getattr(inner, FIRST_LAYER_ATTRIBUTE, 0))
        head: Any = getattr(model, "lm_head", None)
        self._head: Projection | None = None
        self._vocab_split: VocabParallelHead | None = None  # a tensor rank's head rows
        self._final_norm: tuple[torch.Tensor, float] | None = None
        if isinstance(head, VocabParallelHead):
            self._vocab_split = head
            head = head.local
        if head is not None and not isinstance(head, AbsentModule):
            self._head = Projection([head], self.bf16)
            self._final_norm = norm_weight(inner.norm, family.layout.norm_offset)
        softcap = getattr(text_config, "final_logit_softcapping", None)
        self._softcap = float(softcap) if softcap else None
        self._cache_dtype = torch.float32
        # Whether `--prefill-activations bf16` runs here (AMX-BF16), read once, and the
        # fewest prompt rows of a step with decode rows that take it (native/prefill.cpp).
        self._bf16_prefill = bf16_prefill_available()
        self._bf16_min_rows = (
            int(torch.ops.exo_native.bf16_prefill_min_rows()) if self._bf16_prefill else 0
        )
        # Each prompt chunk's last row attends by exo's row kernel where its kernels run, so
        # that row's logits do not depend on the chunk (`batch_attention.last_row_attention`).
        self._row_kernel = native_int4_kernel() is not None
        # exo's decode layer (one C++ call per layer for decode steps, `_native_step`) where its
        # kernels run and every layer's projections are held in a form it reads.
        self._decode_layer: Any = None
        if (
            os.environ.get(NATIVE_DECODE_ENV) != "0"
            and native_int4_kernel() is not None
            and all(
                layer.decode_arguments is not None or layer.attention_arguments is not None
                for layer in self.layers
            )
        ):
            self._decode_layer = torch.ops.exo_native.decode_layer
        # Every layer's decode arguments concatenated, for one `decode_layers` call per
        # decode step where no layer all-reduces (built at the first such step).
        self._stacked: tuple[list[Any], ...] | None = None

    @torch.inference_mode()
    def __call__(
        self,
        plan: BatchPlan,
        input_ids: torch.Tensor | None,
        hidden: torch.Tensor | None,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One step (see `batch_attention.LeanStep`): `input_ids` `[T]` int64 on the first
        rank, else `hidden` `[T, hidden]` float32; `position_ids` `[T]` int64; `logit_rows`
        `[R]` int64 or None (return the `[T, hidden]` float32 hidden states).

        Returns:
            `[R, vocab]` float32 logits, or the hidden states.
        """
        if input_ids is not None:
            if self._embedding is None:
                raise RuntimeError("the token embedding is not on this pipeline rank")
            x = self._embedding(input_ids).float()
            self._place_image_rows(plan, x)
        else:
            assert hidden is not None
            x = hidden.float().clone()  # (image rows in place: a later pipeline rank)
        deepstack = self._deepstack(plan)
        cache_dtype = plan.cache.keys[0].dtype if plan.cache.keys else torch.float32
        # A bfloat16 cache only stores keys and values rounded: attention computes in float32.
        attention_dtype = torch.float32 if cache_dtype == torch.bfloat16 else cache_dtype
        if plan.rotary_positions is not None:
            tables = self._multimodal_tables(x, plan.rotary_positions, attention_dtype)
        else:
            tables = self._rotary_tables(x, position_ids, attention_dtype)
        if (
            not deepstack
            and attention_dtype == torch.float32
            and self._native_step(plan, x.shape[0])
        ):
            self._decode_layers(plan, x, tables)
        else:
            # A step of prompt rows only: block weights take the integer GEMM at any row
            # count, so each row comes out the same bits however the prompt was chunked
            # (`quantized_linear.PROMPT_PRODUCT`).
            prompt = PROMPT_PRODUCT.set(bool(plan.prefill) and not plan.decode_slots)
            try:
                for index, layer in enumerate(self.layers):
                    self._layer(plan, index, layer, x, tables[layer.rope], attention_dtype)
                    after = self._first_layer + index  # the layer's global index
                    for row, features in deepstack:  # Qwen3-VL: after layer k, feature k
                        if after < features.shape[1]:
                            x[row : row + features.shape[0]] += features[:, after]
            finally:
                PROMPT_PRODUCT.reset(prompt)
        if logit_rows is None:
            return x
        assert self._head is not None and self._final_norm is not None
        rows = x.index_select(0, logit_rows)
        weight, eps = self._final_norm
        normed = self._norm(rows, weight, eps)
        logits = self._head(normed.to(self._head.in_dtype)).float()
        if self._vocab_split is not None:  # this rank's vocabulary columns → all of them
            logits = self._vocab_split.gather(logits)
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _place_image_rows(self, plan: BatchPlan, x: torch.Tensor) -> None:
        """The plan's image rows (`BatchPlan.row_embeddings`: their first `hidden` columns)
        written over their rows of the embedded `x` `[T, hidden]`, in place.

        Raises:
            ValueError: image rows whose width is not a whole number of hidden sizes.
        """
        hidden = self._hidden_size
        for row, embeddings in plan.row_embeddings:  # image tokens: vision features
            count, width = embeddings.shape
            if width % hidden:
                raise ValueError(f"image rows of width {width} for a hidden size of {hidden}")
            x[row : row + count] = embeddings[:, :hidden]

    def _deepstack(self, plan: BatchPlan) -> list[tuple[int, torch.Tensor]]:
        """`(row, features [n, layers, hidden])` for the plan's image rows that carry
        deepstack features (rows `[n, hidden x (1 + layers)]`: Qwen3-VL), feature k to add
        after global decoder layer k; empty without them."""
        hidden = self._hidden_size
        return [
            (row, embeddings[:, hidden:].reshape(embeddings.shape[0], -1, hidden))
            for row, embeddings in plan.row_embeddings
            if embeddings.shape[1] > hidden
        ]

    def _norm(self, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of float32 rows `[T, hidden]` (exo's one-pass kernel where its int4
        kernels run, else `F.rms_norm`)."""
        if self._native_norm is not None:
            return self._native_norm(rows.contiguous(), weight, eps)
        return F.rms_norm(rows, (self._hidden_size,), weight, eps)

    def _rotary_tables(
        self, x: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> RotaryTables:
        """Each rope kind's whole-head tables (`direct_forward_parts.rotary_tables`) for the step's
        positions `[T]`: `cos` / `sin` `[T, 1, head_dim]`, `perm` `[head_dim]`.

        Where every rope kind's frequencies are static, the tables come from
        `RotaryCache` (the rotary module run once per block of positions, then one row
        gather per step; the same values, the module being elementwise in the position):
        the gathers cost a small fraction of calling the module every step (figures:
        docs/benchmarks/engine-design-figures.md#direct_forwardpy)."""
        if self._rotary_cache is not None:
            return self._rotary_cache.tables(position_ids, dtype, x.device)
        return self._computed_rotary_tables(position_ids, dtype, x.device)

    def _multimodal_tables(
        self, x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RotaryTables:
        """Each rope kind's whole-head tables for multimodal positions `[3, T]` (temporal,
        height, width; `BatchPlan.rotary_positions`): the 1-D tables of each row, their
        frequencies picked per `mrope_section` (`multimodal_rotary_tables`).

        Raises:
            ValueError: the model has no `mrope_section` (its rotary is 1-D).
        """
        if self._mrope_section is None:
            raise ValueError("multimodal rotary positions for a model without mrope_section")
        positions = positions.to(x.device)
        per_row = [self._rotary_tables(x, positions[row], dtype) for row in range(3)]
        return [
            multimodal_rotary_tables(
                [tables[kind] for tables in per_row],
                self._mrope_section,
                interleaved=self._mrope_interleaved,
            )
            for kind in range(len(per_row[0]))
        ]

    def _computed_rotary_tables(
        self, position_ids: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> RotaryTables:
        """The rotary module's tables for `position_ids` `[T]` (int64), one per rope kind."""
        probe = torch.empty(1, 1, 1, dtype=dtype, device=device)  # read for dtype and device
        positions = position_ids[None]
        tables = []
        head_dim = self.layers[0].head_dim if self.layers else 1
        for kind in self._rope_kinds:
            if kind is None:
                cos, sin = self._rotary(probe, positions)
            else:
                cos, sin = self._rotary(probe, positions, kind)
            cos, sin = cos[0], sin[0]
            if self._per_frequency:  # one value per frequency: both halves of a head
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            tables.append(rotary_tables(cos, sin, head_dim))
        return tables

    def _native_step(self, plan: BatchPlan, rows: int) -> bool:
        """Whether exo's decode layer runs this step of `rows` rows: it has decode rows,
        and any prompt rows beside them take the decode rows' int16 rounding anyway
        (`--prefill-activations int16`; bf16 with fewer prompt rows than its minimum beside
        decode rows, or where bf16 does not run; not int8, whose prompt rows round to
        int8). A short chunk joining running streams then costs one native pass instead of
        ~30 torch operators per layer, which shortens the running streams' step (figures:
        docs/benchmarks/engine-design-figures.md#direct_forwardpy)."""
        if self._decode_layer is None or not plan.decode_slots:
            return False
        if not plan.prefill:
            return True
        prompt_rows = rows - len(plan.decode_slots)
        for layer in self.layers:
            for projection in (layer.qkv, layer.output, layer.gate_up, layer.down):
                if projection is None:  # a MoE layer's MLP (its experts run outside)
                    continue
                activations = projection.prefill_activations
                if activations == "int8" or (
                    activations == "bf16"
                    and self._bf16_prefill
                    and prompt_rows >= self._bf16_min_rows
                ):
                    return False
        return True

    def _decode_layers(
        self,
        plan: BatchPlan,
        x: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """Every layer of a step by exo's decode layer (rows = the plan's decode slots in
        order, then each prompt segment's positions), over `x` `[T, hidden]` float32 in
        place: one `decode_layers` call for them all, or on a tensor rank three calls per
        layer around its two all-reduces."""
        rows = x.shape[0]
        flat = [
            (cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous(), perm)
            for cos, sin, perm in tables
        ]
        slots, positions = list(plan.decode_slots), list(plan.decode_positions)
        for segment in sorted(plan.prefill, key=lambda segment: segment.offset):
            if segment.offset != len(slots):
                raise ValueError(f"prompt segment at row {segment.offset}, expected {len(slots)}")
            slots += [segment.slot] * segment.length
            positions += range(segment.start, segment.start + segment.length)
        if len(slots) != rows:
            raise ValueError(f"the plan places {len(slots)} rows, the step has {rows}")
        cache = plan.cache
        if not any(layer.reduced or layer.decode_arguments is None for layer in self.layers):
            # One call for every layer.
            linears, norms, epsilons, ropes, shapes, scalings = self._stacked_arguments()
            windows = plan.windows
            for index in range(len(self.layers)):
                shapes[5 * index + 4] = windows[index] or 0
            torch.ops.exo_native.decode_layers(
                x, linears, norms, epsilons, cache.keys, cache.values, slots, positions,
                [table[0] for table in flat], [table[1] for table in flat],
                [table[2] for table in flat], ropes, shapes, scalings,
            )  # fmt: skip
            return
        partial = torch.empty_like(x)  # a tensor rank's projections' partial sums
        for index, layer in enumerate(self.layers):
            cos, sin, perm = flat[layer.rope]
            window = plan.windows[index]
            if layer.decode_arguments is None:  # a MoE layer: its attention, then its experts
                assert layer.attention_arguments is not None
                linears, norms, epsilons, activation = layer.attention_arguments
                self._decode_layer(
                    x, linears, norms, epsilons, cache.keys[index], cache.values[index], slots,
                    positions, cos, sin, perm, layer.heads, layer.kv_heads, layer.head_dim,
                    activation, window or 0, layer.scaling, partial, 1,
                )  # fmt: skip
                if layer.output.reduce:
                    all_reduce_sum(partial)
                self._finish_attention(layer, x, partial)
                self._mlp(layer, x)
                continue
            assert layer.decode_arguments is not None
            linears, norms, epsilons, activation = layer.decode_arguments
            # The whole layer (stage 0), or on a tensor rank stages 1-3 with the two
            # all-reduces between them (see decode_layer.cpp).
            for stage in (1, 2, 3) if layer.reduced else (0,):
                if stage == 2 or stage == 3:
                    all_reduce_sum(partial)
                self._decode_layer(
                    x, linears, norms, epsilons, cache.keys[index], cache.values[index], slots,
                    positions, cos, sin, perm, layer.heads, layer.kv_heads, layer.head_dim,
                    activation, window or 0, layer.scaling, partial, stage,
                )  # fmt: skip

    def _stacked_arguments(self) -> tuple[list[Any], ...]:
        """`decode_layers`' per-layer arguments, concatenated over the layers: linears,
        norms, epsilons, rotary table indices, shapes (heads, KV heads, head dim,
        activation, window: the window is filled in per step), scalings."""
        if self._stacked is None:
            linears: list[torch.Tensor | None] = []
            norms: list[torch.Tensor | None] = []
            epsilons: list[float] = []
            ropes: list[int] = []
            shapes: list[int] = []
            scalings: list[float] = []
            for layer in self.layers:
                assert layer.decode_arguments is not None
                layer_linears, layer_norms, layer_epsilons, activation = layer.decode_arguments
                linears += layer_linears
                norms += layer_norms
                epsilons += layer_epsilons
                ropes.append(layer.rope)
                shapes += [layer.heads, layer.kv_heads, layer.head_dim, activation, 0]
                scalings.append(float(layer.scaling))
            self._stacked = (linears, norms, epsilons, ropes, shapes, scalings)
        return self._stacked

    def _layer(
        self,
        plan: BatchPlan,
        index: int,
        layer: LeanLayer,
        x: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attention_dtype: torch.dtype,
    ) -> None:
        """Layer `index` over the residual stream `x` `[T, hidden]` float32, in place."""
        weight, eps = layer.input_norm
        if layer.latent is not None:  # MLA over the compressed cache (`direct_forward_mla`)
            normed = self._norm(x, weight, eps)

            def attend_latent(
                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
            ) -> torch.Tensor:
                return attend(plan, index, query, key, value, scaling)

            out = layer.latent(normed, table, attend_latent, attention_dtype)
        else:
            out = self._attention(plan, index, layer, x, table, attention_dtype)
        if layer.post_attention_norm is not None:
            weight, eps = layer.post_attention_norm
            out = self._norm(out.float(), weight, eps)
        x.add_(out)
        self._mlp(layer, x)

    def _attention(
        self,
        plan: BatchPlan,
        index: int,
        layer: LeanLayer,
        x: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attention_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Layer `index`'s Q/K/V attention over `x` `[T, hidden]` float32: its output
        projection's `[T, hidden]` rows."""
        rows = x.shape[0]
        heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
        assert layer.qkv is not None
        weight, eps = layer.input_norm
        normed = self._norm(x, weight, eps).to(layer.qkv.in_dtype)
        qkv = layer.qkv(normed).to(attention_dtype)  # [T, (heads + 2 kv_heads) * head_dim]
        if layer.projection_qk_norm is not None:  # norms over all heads (MiniMax-M2)
            qkv = layer.projection_qk_norm(qkv)
        width = (heads + kv_heads) * head_dim
        cos, sin, perm = table
        if self._qk_norm_rotary is not None and qkv.dtype == torch.float32:
            qkv = qkv.contiguous()
            qk_weight, qk_eps = layer.qk_norm if layer.qk_norm is not None else (None, 0.0)
            self._qk_norm_rotary(
                qkv, heads + kv_heads, head_dim, qk_weight, qk_eps,
                cos.reshape(rows, head_dim), sin.reshape(rows, head_dim), perm,
            )  # fmt: skip
            qk = qkv[:, :width].view(rows, heads + kv_heads, head_dim)
        else:
            qk = qkv[:, :width].view(rows, heads + kv_heads, head_dim)
            if layer.qk_norm is not None:
                qk_weight, qk_eps = layer.qk_norm
                qk = F.rms_norm(qk, (head_dim,), None, qk_eps) * qk_weight
            qk = qk * cos + qk.index_select(-1, perm) * sin
        query = qk[:, :heads].transpose(0, 1).unsqueeze(0)  # [1, heads, T, head_dim]
        key = qk[:, heads:].transpose(0, 1).unsqueeze(0)
        value = qkv[:, width:].view(rows, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
        # With bf16 prefill activations a prompt chunk attends in bfloat16 too (AMX tiles),
        # where the step's products take bf16 (not a short chunk beside decode rows).
        decoding = len(plan.decode_slots)
        prefill_dtype = (
            torch.bfloat16
            if self._bf16_prefill
            and (decoding == 0 or rows - decoding >= self._bf16_min_rows)
            and layer.qkv.prefill_activations == "bf16"
            else None
        )
        attended = attend(
            plan, index, query, key, value, layer.scaling, prefill_dtype, layer.sinks,
            row_kernel=self._row_kernel and query.dtype == torch.float32,
        )  # fmt: skip
        return layer.output(attended.view(rows, heads * head_dim).to(layer.output.in_dtype))

    def _finish_attention(self, layer: LeanLayer, x: torch.Tensor, out: torch.Tensor) -> None:
        """The attention's residual over `x` in place, from its output projection's rows
        `out` `[T, hidden]` float32 without the bias (the decode layer's stage 1, summed
        over the ranks): as `_layer` finishes it, the bias, post-attention norm and add."""
        if layer.output.bias is not None:
            out.add_(layer.output.bias.float())
        if layer.post_attention_norm is not None:
            weight, eps = layer.post_attention_norm
            out = self._norm(out, weight, eps)
        x.add_(out)

    def _mlp(self, layer: LeanLayer, x: torch.Tensor) -> None:
        """The layer's MLP (dense or sparse) over `x` `[T, hidden]` float32, added in place."""
        weight, eps = layer.pre_mlp_norm
        if layer.moe is not None:  # routed experts, grouped by expert (`LeanMoe`)
            # An expert's few rows keep their decode kernels (not `PROMPT_PRODUCT`).
            dense = PROMPT_PRODUCT.set(False)
            try:
                out = layer.moe(self._norm(x, weight, eps))
            finally:
                PROMPT_PRODUCT.reset(dense)
        else:
            assert layer.gate_up is not None and layer.down is not None
            assert layer.activation is not None
            normed = self._norm(x, weight, eps).to(layer.gate_up.in_dtype)
            gate_up = layer.gate_up(normed)  # [T, 2 * intermediate]
            middle = layer.intermediate
            if self._gated_activation is not None and gate_up.dtype == torch.float32:
                activated = self._gated_activation(gate_up.contiguous(), layer.activation_number)
            else:
                activated = layer.activation(gate_up[:, :middle]).mul_(gate_up[:, middle:])
            out = layer.down(activated.to(layer.down.in_dtype))
        if layer.post_mlp_norm is not None:
            weight, eps = layer.post_mlp_norm
            out = self._norm(out.float(), weight, eps)
        x.add_(out)


def enable_lean_forward(
    model: nn.Module, family: ModelFamily, bf16: bool | None = None
) -> LeanModel | None:
    """Build the model's `LeanModel` (fusing its Q/K/V and gate/up linears) and attach it
    so `forward_batch` runs it; None (transformers' forward stays, with a log line naming
    the reason) when `LEAN_ENV` is "0" or the model has a part without lean code.

    Raises:
        UnsupportedArchitectureError: a multi-head latent attention family
            (`DecoderLayout.latent_attention`) the lean forward cannot run: its KV cache
            holds latents, which transformers' attention does not give the batched
            attention (`LEAN_ENV` does not turn such a family's lean forward off).
    """
    latent = family.layout is not None and family.layout.latent_attention
    if os.environ.get(LEAN_ENV) == "0" and not latent:
        logger.info("lean forward off ({}=0): batched steps run transformers' forward", LEAN_ENV)
        return None
    try:
        lean = LeanModel(model, family, bf16)
    except (LeanUnsupportedError, UnsupportedArchitectureError) as error:
        if latent:  # transformers' MLA expands keys and values: no use of a latent cache
            raise UnsupportedArchitectureError(
                f"the {family.name} family runs on the lean forward only, which cannot run "
                f"this model: {error}"
            ) from error
        logger.warning(
            "no lean forward for {}: {}; using transformers' forward", family.name, error
        )
        return None
    attach_lean_step(model, lean)
    logger.debug(
        "lean forward for {} ({} layers, {} activations)", family.name, len(lean.layers),
        "bfloat16" if lean.bf16 else "float32",
    )  # fmt: skip
    return lean

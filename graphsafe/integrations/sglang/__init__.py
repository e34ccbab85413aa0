"""graphsafe inside SGLang, attached to SGLang's own classes without editing SGLang.

Turn it on before the engine starts, naming the registries that declare your derived
buffers (`"module:attribute"`, a `gs.Registry` or a function returning one):

    from graphsafe.integrations import sglang as gss
    gss.enable(gss.DEEPSEEK_MLA)            # sets GRAPHSAFE_SGLANG_REGISTRIES
    engine = sglang.Engine(model_path=...)

`gss.enable()` with no registry declares nothing: graphsafe then checks only what
SGLang's own code derives from the weights, found by provenance.

SGLang loads graphsafe's `sglang.srt.plugins` entry point in every process it starts;
with `GRAPHSAFE_SGLANG_REGISTRIES` set, the plugin patches SGLang's classes there:

- `ModelRunner.load_model`: SGLang's first load (its `load_weights` and
  `post_load_weights`) runs under graphsafe's lineage recorder; then graphsafe's runtime
  is bound to the loaded model with those registries, the derived buffers are
  materialized (adopting in place the tensors SGLang bound, such as MLA's `w_kc`/`w_vc`),
  and what that load computed from the weights without a declaration is discovered;
- after `ModelRunner.init_cuda_graphs` (where SGLang captures its CUDA graphs, and which
  it calls without graphs too): pins the model;
- `update_weights_from_disk`, `update_weights_from_tensor` (every `load_format`,
  `"direct"` included), `update_weights_from_distributed`'s load,
  `update_weights_from_ipc`, the session
  `begin_weight_update` ... `end_weight_update` and `model.load_weights` each run as one
  graphsafe weight update: derived buffers refresh once, at its end, and a rebound tensor
  is refused there. SGLang's scheduler stops the engine on an exception, so a refused
  update returns SGLang's `(False, message)` with graphsafe's text, and the model is
  failed closed until a load completes;
- before each `ModelRunner.forward`: the guard's checks (nothing moved, nothing stale,
  declared or discovered, the last update ended and held).

SGLang's own refusal of online updates (a module carrying `_derived_weight_cache_error`,
and its other startup-determined refusals) stays in force: such an update is SGLang's
to refuse, before it writes anything, and graphsafe does not open one for it.
"""

from __future__ import annotations

from graphsafe.integrations.sglang._attachment import Attachment as Attachment
from graphsafe.integrations.sglang._attachment import attachment as attachment
from graphsafe.integrations.sglang._deepseek import DEEPSEEK_MLA as DEEPSEEK_MLA
from graphsafe.integrations.sglang._deepseek import deepseek_mla_registry as deepseek_mla_registry
from graphsafe.integrations.sglang._patches import attach as attach
from graphsafe.integrations.sglang._patches import install as install
from graphsafe.integrations.sglang._plugin import enable as enable
from graphsafe.integrations.sglang._plugin import plugin as plugin
from graphsafe.integrations.sglang._registries import ENV as ENV
from graphsafe.integrations.sglang._registries import registries_from as registries_from

__all__ = [
    "DEEPSEEK_MLA",
    "ENV",
    "Attachment",
    "attach",
    "attachment",
    "deepseek_mla_registry",
    "enable",
    "install",
    "plugin",
    "registries_from",
]

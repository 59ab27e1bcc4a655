"""The K3 model: the modules and their forward (`transformer`), where params come from —
init, abstract shapes, logical axes, shardings (`params`) — and the model side of images
(`multimodal`). The names below are the package's surface; `from k3jax.model import ...`."""
from k3jax.model.params import (ParamInfo, abstract_adapters, abstract_params, abstract_variables, adapter_shapes,
                                init_params, init_params_sharded, param_infos, param_shapes, param_shardings,
                                param_specs, shard_params)
from k3jax.model.transformer import LORA_KEY, K3Model, forward, validate_inputs, variables_of

__all__ = ["K3Model", "LORA_KEY", "ParamInfo", "abstract_adapters", "abstract_params", "abstract_variables",
           "adapter_shapes", "forward", "init_params", "init_params_sharded", "param_infos", "param_shapes",
           "param_shardings", "param_specs", "shard_params", "validate_inputs", "variables_of"]

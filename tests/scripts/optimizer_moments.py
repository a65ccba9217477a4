"""Adam's moments of every parameter, whole (every rank's shards joined), under ZeRO-1, 2 or 3: what a resize must
carry bit for bit. Collective: every rank calls it; each gets the whole tensors."""

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def whole_moments(zero_optimizer, named_parameters, stage: int) -> dict[str, torch.Tensor]:
    """``{"<parameter name>.exp_avg": tensor, ...}`` on the CPU, from DeepSpeed's ZeRO optimizer of an engine."""
    named = list(named_parameters)
    moments = _zero3_moments(named) if stage == 3 else _zero12_moments(zero_optimizer, named)
    return {name: value.detach().clone().cpu() for name, value in moments.items()}


def _zero3_moments(named) -> dict:
    from deepspeed.utils import safe_get_full_optimizer_state

    return {f"{name}.{key}": safe_get_full_optimizer_state(p, key) for name, p in named for key in MOMENTS}


def _zero12_moments(zero_optimizer, named) -> dict:
    """Under ZeRO-1/2 each rank holds one equal slice of each group's flat fp32 state: gather the slices, cut the
    flat tensor back into the group's parameters (in their order; the padding is at the end)."""
    names = {id(p): name for name, p in named}
    moments = {}
    for group, partition in zip(
        zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups, strict=True
    ):
        state = zero_optimizer.optimizer.state[partition]
        for key in MOMENTS:
            pieces = [torch.empty_like(state[key]) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(pieces, state[key])
            flat, offset = torch.cat(pieces), 0
            for param in group:
                moments[f"{names[id(param)]}.{key}"] = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
    return moments

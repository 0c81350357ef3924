"""DeepSpeed's model-state estimators, under its names and signatures, printing its tables:
estimate_zero2_model_states_mem_needs_all_live / _all_cold (deepspeed.runtime.zero.stage_1_and_2)
and estimate_zero3_model_states_mem_needs_all_live / _all_cold (deepspeed.runtime.zero.stage3), and
each module's model_to_params (zero2_ / zero3_model_to_params here: their results differ).
They count model states only with DeepSpeed's rules of thumb (16-bit parameters and gradients,
fp32 master and Adam moments, a 1.5x host buffer factor); zeroshard.plan() counts what zeroshard
itself allocates, activations included."""

_GiB = 2**30


def zero2_model_to_params(model) -> int:
    """DeepSpeed's stage_1_and_2.model_to_params: every parameter once, shared ones (tied
    embeddings) once."""
    return sum({p.data_ptr() if p.device.type != "meta" else id(p): p.numel() for p in model.parameters()}.values())


def zero3_model_to_params(model):
    """DeepSpeed's stage3.model_to_params: (total parameters, the most one module holds directly,
    its "largest layer")."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return zero2_model_to_params(model), largest


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5):
    """(host bytes per node, device bytes per GPU) of ZeRO-2 model states. On the device: 16-bit
    parameters, and unless offloaded the shard of 16-bit gradients, fp32 gradients, fp32 master and
    two Adam moments (18 bytes per parameter over all GPUs). On the host: with offload the shard of
    master, moments and gradients (at least 16 bytes per parameter, 4 per GPU), else a 4-byte
    copy per local GPU; both times the buffer factor."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5):
    """(host bytes per node, device bytes per GPU, largest layer's bytes) of ZeRO-3 model states.
    The device always holds the largest layer gathered in fp32 terms (4 bytes per parameter); then
    the 16-bit parameter shard unless parameters are offloaded, and the 18 bytes per parameter of
    gradients, master and moments over all GPUs unless the optimizer is offloaded. The host holds
    16 (18 with parameters) bytes per parameter over the nodes with zero_init, or at least a
    4-byte copy per local GPU without; both times the buffer factor."""
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        host_bytes = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / gpus)
        factor = host_bytes * per_node if zero_init else max(4 * num_gpus_per_node, host_bytes * per_node)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


def _header(total_params, num_gpus_per_node, num_nodes, largest=None):
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest is not None:
        model += f", {int(largest / 1e6)}M largest layer params"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{model}.")
    print("  per CPU  |  per GPU |   Options")


def _line(cpu, gpu, options):
    print(f" {cpu / _GiB:7.2f}GB | {gpu / _GiB:6.2f}GB | {options}")


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """Prints DeepSpeed's ZeRO-2 table for a model of `total_params` parameters: host and device
    bytes with and without optimizer offload."""
    _header(total_params, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        _line(cpu, gpu, f"offload_optimizer={'cpu ' if offload else 'none'}")


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """estimate_zero2_model_states_mem_needs_all_cold for an nn.Module (a meta-device one too)."""
    estimate_zero2_model_states_mem_needs_all_cold(zero2_model_to_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """Prints DeepSpeed's ZeRO-3 table: host and device bytes for parameter and optimizer offload
    on or off, with and without zero.Init."""
    _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for offload in (True, False):
        for offload_params in (True, False):
            if offload_params and not offload:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, offload, offload_params,
                    zero_init, additional_buffer_factor)
                _line(cpu, gpu, f"offload_param={'cpu ' if offload_params else 'none'}, "
                                f"offload_optimizer={'cpu ' if offload else 'none'}, zero_init={int(zero_init)}")


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """estimate_zero3_model_states_mem_needs_all_cold for an nn.Module (a meta-device one too)."""
    estimate_zero3_model_states_mem_needs_all_cold(*zero3_model_to_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor)

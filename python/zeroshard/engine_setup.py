"""What ZeroShardEngine's set-up derives from the script's arguments before any communicator
exists: the optimizer's parameter groups, and the checks of a zero.Init model that every rank
makes alike (zeroshard/engine.py)."""
from zeroshard.zero.partition_init import full_shape


def check_partitioned(module, groups, stage):
    """Parameters partitioned under zero.Init need stage 3 and a place: an optimizer group or frozen."""
    chunked = [n for n, p in module.named_parameters() if full_shape(p) is not None]
    if chunked and stage != 3:
        raise ValueError(f"zero.Init: a model built under zeroshard.zero.Init needs "
                         f"zero_optimization.stage 3 (stage is {stage}); "
                         f"partitioned parameters: {', '.join(chunked[:3])}")
    trainable_ids = {id(p) for _, ps in groups for p in ps}
    stray = [(n, p) for n, p in module.named_parameters()
             if full_shape(p) is not None and id(p) not in trainable_ids
             and (p.requires_grad or not p.is_floating_point())]  # frozen floating ones are partitioned
    if stray:
        names = ", ".join(n for n, _ in stray[:3])
        if any(not p.is_floating_point() for _, p in stray):
            raise ValueError(f"zero.Init: {names} partitioned under zeroshard.zero.Init have "
                             "a non-floating dtype, which ZeRO-3 does not gather; create them "
                             "outside zero.Init")
        raise ValueError(f"zero.Init: {names} were partitioned under zeroshard.zero.Init but "
                         "are neither in the optimizer's parameter groups nor frozen "
                         "(requires_grad=False); pass them to the optimizer or freeze them")


def _passed_groups(model, model_parameters, client_optimizer):
    """[(group_dict_without_params, [params])] from whatever the script passed. A client
    optimizer's own group dicts are returned (not copies), so a scheduler built on it still
    drives the lr the engine uses."""
    if client_optimizer is not None:
        return [(g, list(g["params"])) for g in client_optimizer.param_groups]
    source = model.parameters() if model_parameters is None else model_parameters
    items = list(source)
    if items and isinstance(items[0], dict):
        return [({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in items]
    return [({}, items)]


def param_groups(model, model_parameters, client_optimizer, defaults):
    """([(group dict, [trainable params])], [whether the script passed the group no parameters]): the
    optimizer's groups, each dict's "params" its trainable ones (none for an all-frozen group, which
    stays); a client optimizer's dicts themselves, otherwise `defaults` under the script's keys."""
    groups, passed_empty = [], []
    for hyper, params in _passed_groups(model, model_parameters, client_optimizer):
        passed_empty.append(not params)
        trainable = [p for p in params if p.requires_grad]
        if client_optimizer is not None:
            hyper["params"] = trainable  # the client's dict itself
            groups.append((hyper, trainable))
        else:
            groups.append(({**defaults, **hyper, "params": trainable}, trainable))
    return groups, passed_empty

"""`zeroshard plan`: the memory planner from the command line. The model is a Hugging Face-style
config.json or flags; prints every setup's table and writes the recommendation's ds_config.json."""
import argparse
import inspect
import sys

from zeroshard.planner.model import Decoder, decoder_from_hf
from zeroshard.planner.plan import plan
from zeroshard.planner.states import DEFAULT_OPTIMIZER


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zeroshard plan", description=(
        "What every ZeRO stage / offload / pipeline setup needs per GPU and per node, whether it "
        "fits, and the fastest one that does (its ds_config.json goes to --out)."))
    m = p.add_argument_group("model: a Hugging Face-style config.json, or the decoder's shape")
    m.add_argument("model_config", nargs="?", help="config.json (num_hidden_layers, hidden_size, ...)")
    m.add_argument("--arch", choices=("gpt", "llama"),
                   help="decoder family for the flags (default llama: RMSNorm, SwiGLU, untied head)")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int, help="grouped-query attention (default: heads)")
    m.add_argument("--intermediate", type=int, help="MLP width (default: the family's rule)")
    m.add_argument("--vocab", type=int)
    m.add_argument("--name", default="", help="the model's name in the table")
    r = p.add_argument_group("run")
    r.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's max positions)")
    r.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    r.add_argument("--gradient-accumulation-steps", type=int, default=1)
    r.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                   help="default: the --config's bf16 / fp16 blocks, else bf16")
    r.add_argument("--optimizer", help=f"when --config names none (default {DEFAULT_OPTIMIZER})")
    r.add_argument("--config", help="a ds_config.json whose other keys the setups keep")
    r.add_argument("--pipeline-stages", default="1",
                   help="comma-separated stage counts to consider, e.g. 1,2,4 (default 1)")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpus-per-node", type=int, required=True)
    h.add_argument("--nodes", type=int, default=1)
    h.add_argument("--device-memory", required=True, help="per GPU: 80GB (10^9 bytes), 80GiB, ...")
    h.add_argument("--host-memory", required=True, help="per node")
    h.add_argument("--nvme", help="NVMe space per node (default: none, no NVMe setups)")
    h.add_argument("--nvme-path", default="/local_nvme", help="nvme_path written into an NVMe setup's config")
    p.add_argument("--out", help="write the recommended setup's ds_config.json here")
    return p


_SHAPE_FLAGS = ("arch", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


def _model(args, parser):
    if args.model_config:
        given = [f"--{k.replace('_', '-')}" for k in _SHAPE_FLAGS if getattr(args, k) is not None]
        if given:
            parser.error(f"{' '.join(given)}: the model's shape comes from {args.model_config}; give one or the other")
        return decoder_from_hf(args.model_config)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "seq_len") if getattr(args, k) is None]
    if missing:
        parser.error(f"give a model config.json, or {' '.join(m.replace('_', '-') for m in missing)}")
    arch = args.arch or "llama"
    return Decoder(arch=arch, layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                   seq_len=args.seq_len, kv_heads=args.kv_heads or 0, intermediate=args.intermediate or 0,
                   tie_embeddings=arch == "gpt")


# plan()'s keyword arguments whose flag is not the keyword with dashes.
_FLAG_OF = {"nvme_space": "--nvme"}


def _in_flag_terms(message: str) -> str:
    """plan()'s error under the flag it is about: "plan: pipeline_stages: got ..." reads
    "--pipeline-stages: got ..."; anything else loses only the "plan: " that main prints anyway."""
    message = message.removeprefix("plan: ")
    kwarg, sep, rest = message.partition(": ")
    if not sep or kwarg not in inspect.signature(plan).parameters:
        return message
    return f"{_FLAG_OF.get(kwarg, '--' + kwarg.replace('_', '-'))}: {rest}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        stages = [int(s) for s in args.pipeline_stages.split(",")]
    except ValueError:
        parser.error(f"--pipeline-stages: got {args.pipeline_stages!r}, expected comma-separated integers "
                     ">= 1 such as 1,2,4")
    try:
        result = plan(_model(args, parser), gpus_per_node=args.gpus_per_node, nodes=args.nodes,
                      device_memory=args.device_memory, host_memory=args.host_memory, nvme_space=args.nvme,
                      micro_batch=args.micro_batch, seq_len=args.seq_len,
                      gradient_accumulation_steps=args.gradient_accumulation_steps, precision=args.precision,
                      optimizer=args.optimizer, config=args.config, pipeline_stages=stages,
                      nvme_path=args.nvme_path, name=args.name)
    except (ValueError, OSError) as e:
        print(f"zeroshard plan: {_in_flag_terms(str(e))}", file=sys.stderr)
        return 2
    print(result.table())
    if args.out:
        if result.recommended is None:
            print(f"zeroshard plan: nothing fits, so {args.out} was not written", file=sys.stderr)
            return 1
        result.write_config(args.out)
        print(f"wrote {args.out}")
    return 0 if result.recommended is not None else 1

// Builds the per-rank instruction lists of each pipeline schedule; see schedule.h.
// Each schedule is first a per-rank order of compute passes (the part the papers define; one file
// each in schedules/); one simulation then places every send and receive, the same for all
// schedules.
#include "pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <limits>

#include "pipeline/schedules/pass_order.h"
#include "runtime/error.h"

namespace zeroshard::pipeline {

namespace {

using schedules::Pass;
using schedules::PassOrder;
using schedules::pass_order;

// A tensor a finished pass owes a neighbouring stage on another rank.
struct Message {
  Op send;  // send_activation or send_gradient
  int micro_batch;
  int chunk;       // the sender's
  int to_rank;
  int to_chunk;
};

struct RankRun {
  PassOrder order;
  size_t next = 0;
  bool busy = false;
  double busy_until = 0;
  Pass running{Op::forward, 0, 0};
  std::vector<bool> loaded;  // per micro-batch: this rank's load ran
  std::deque<Message> outbox;
  std::vector<Instruction> list;
};

// Places sends and receives by simulating all ranks with unit costs. A send and its receive are
// appended to both lists at the same simulated moment, only when neither rank is inside a pass,
// so the lists are projections of one global order in which every send meets its receive: that
// order is a witness that they run under rendezvous semantics (and so with buffered sends too),
// whatever the real costs. A rank whose receiver is busy goes on computing and sends later, so
// no pass waits on a send. A training step's lists end with the reductions and the optimizer
// step (`training`); eval_batch's end at their last transfer.
class Placement {
 public:
  Placement(const PipelineShape& shape, std::vector<PassOrder> orders, bool training)
      : shape_(shape), training_(training) {
    const size_t cells = size_t(shape.num_global_stages()) * shape.num_micro_batches;
    activation_in_.assign(cells, false);
    gradient_in_.assign(cells, false);
    ranks_.resize(orders.size());
    for (size_t r = 0; r < orders.size(); ++r) {
      ranks_[r].order = std::move(orders[r]);
      ranks_[r].loaded.assign(shape.num_micro_batches, false);
    }
  }

  std::vector<std::vector<Instruction>> run() {
    double now = 0;
    for (;;) {
      for (int r = 0; r < int(ranks_.size()); ++r) finish_pass(r, now);
      deliver();
      bool running = false;
      for (int r = 0; r < int(ranks_.size()); ++r) running |= start_pass(r, now);
      double next = std::numeric_limits<double>::infinity();
      for (const RankRun& rank : ranks_)
        if (rank.busy) next = std::min(next, rank.busy_until);
      if (!running && next == std::numeric_limits<double>::infinity()) break;
      now = next;
    }
    std::vector<std::vector<Instruction>> lists;
    for (int r = 0; r < int(ranks_.size()); ++r) {
      RankRun& rank = ranks_[r];
      ZS_CHECK(rank.next == rank.order.size() && rank.outbox.empty(), "schedule builder: rank ",
               r, " is stuck before pass ", rank.next, " of ", rank.order.size());
      if (training_)
        for (Op op : {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step})
          rank.list.push_back({op});
      lists.push_back(std::move(rank.list));
    }
    return lists;
  }

 private:
  size_t cell(int stage, int micro_batch) const {
    return size_t(stage) * shape_.num_micro_batches + micro_batch;
  }

  bool ready(int rank, const Pass& pass) const {
    const int stage = shape_.global_stage(rank, pass.chunk);
    if (pass.op == Op::forward) return stage == 0 || activation_in_[cell(stage, pass.micro_batch)];
    if (pass.op == Op::backward_weight) return true;  // its backward_input ran on this rank
    return stage == shape_.num_global_stages() - 1 || gradient_in_[cell(stage, pass.micro_batch)];
  }

  bool start_pass(int r, double now) {
    RankRun& rank = ranks_[r];
    if (rank.busy) return true;
    if (rank.next == rank.order.size() || !ready(r, rank.order[rank.next])) return false;
    const Pass pass = rank.order[rank.next++];
    const int stage = shape_.global_stage(r, pass.chunk);
    // The first stage loads the inputs, the last the labels. One load per micro-batch and rank
    // (the executor keeps a rank's batch by micro-batch), before the first forward that needs it.
    if (pass.op == Op::forward && (stage == 0 || stage == shape_.num_global_stages() - 1) &&
        !rank.loaded[pass.micro_batch]) {
      rank.loaded[pass.micro_batch] = true;
      rank.list.push_back({Op::load_micro_batch, pass.micro_batch, pass.chunk});
    }
    rank.list.push_back({pass.op, pass.micro_batch, pass.chunk});
    rank.busy = true;
    rank.running = pass;
    rank.busy_until = now + InstructionCosts{}.of(pass.op);
    return true;
  }

  void finish_pass(int r, double now) {
    RankRun& rank = ranks_[r];
    if (!rank.busy || rank.busy_until > now) return;
    rank.busy = false;
    const Pass pass = rank.running;
    const int stage = shape_.global_stage(r, pass.chunk);
    int to_stage = -1;
    Op send = Op::send_activation;
    if (pass.op == Op::forward && stage + 1 < shape_.num_global_stages()) {
      to_stage = stage + 1;
    } else if ((pass.op == Op::backward || pass.op == Op::backward_input) && stage > 0) {
      to_stage = stage - 1;
      send = Op::send_gradient;
    }
    if (to_stage < 0) return;
    const int to_rank = shape_.rank_of(to_stage), to_chunk = shape_.chunk_of(to_stage);
    if (to_rank == r) {
      arrived(send, to_stage, pass.micro_batch);  // one rank (p = 1): handed over in memory
    } else {
      rank.outbox.push_back({send, pass.micro_batch, pass.chunk, to_rank, to_chunk});
    }
  }

  // Every owed tensor whose two ranks are both between passes changes hands now.
  void deliver() {
    for (int r = 0; r < int(ranks_.size()); ++r) {
      RankRun& rank = ranks_[r];
      if (rank.busy) continue;
      for (auto it = rank.outbox.begin(); it != rank.outbox.end();) {
        RankRun& peer = ranks_[it->to_rank];
        if (peer.busy) {
          ++it;
          continue;
        }
        const Op receive =
            it->send == Op::send_activation ? Op::receive_activation : Op::receive_gradient;
        rank.list.push_back({it->send, it->micro_batch, it->chunk, it->to_rank});
        peer.list.push_back({receive, it->micro_batch, it->to_chunk, r});
        arrived(it->send, shape_.global_stage(it->to_rank, it->to_chunk), it->micro_batch);
        it = rank.outbox.erase(it);
      }
    }
  }

  void arrived(Op send, int stage, int micro_batch) {
    auto& flags = send == Op::send_activation ? activation_in_ : gradient_in_;
    flags[cell(stage, micro_batch)] = true;
  }

  PipelineShape shape_;
  bool training_;
  std::vector<RankRun> ranks_;
  std::vector<bool> activation_in_;  // per (global stage, micro-batch): received by that stage
  std::vector<bool> gradient_in_;
};

struct NamedSchedule {
  ScheduleKind kind;
  const char* name;
};
// The one list of the schedules' names (see schedule_names in schedule.h).
constexpr NamedSchedule kScheduleNames[] = {
    {ScheduleKind::gpipe, "gpipe"},
    {ScheduleKind::one_f_one_b, "1f1b"},
    {ScheduleKind::interleaved_1f1b, "interleaved_1f1b"},
    {ScheduleKind::zero_bubble, "zero_bubble"},
};

}  // namespace

double InstructionCosts::of(Op op) const {
  switch (op) {
    case Op::forward: return forward;
    case Op::backward: return backward;
    case Op::backward_input: return backward_input;
    case Op::backward_weight: return backward_weight;
    case Op::send_activation:
    case Op::receive_activation:
    case Op::send_gradient:
    case Op::receive_gradient: return communication;
    default: return 0;
  }
}

namespace {

void validate_counts(const PipelineShape& shape) {
  ZS_REQUIRE(shape.num_stages >= 1, "num_stages: got ", shape.num_stages, ", expected >= 1");
  ZS_REQUIRE(shape.num_micro_batches >= 1, "num_micro_batches: got ", shape.num_micro_batches,
             ", expected >= 1");
  ZS_REQUIRE(shape.virtual_stages >= 1, "virtual_stages: got ", shape.virtual_stages,
             ", expected >= 1");
}

// The one owner of this rule (PipelineModule builds the chunks, the engine asks here): chunks
// interleave over pipeline ranks, and one rank would only run them back to back, a bubble-free
// but slower 1F1B. Megatron-LM refuses an interleaved pipeline of one stage too.
// `lists` names what the lists are for, in the error.
void validate_chunks_have_ranks(const PipelineShape& shape, const char* lists) {
  ZS_REQUIRE(shape.virtual_stages == 1 || shape.num_stages > 1, "virtual_stages: got ",
             shape.virtual_stages, " with num_stages 1, expected 1 for ", lists,
             " (model chunks interleave over several pipeline stages)");
}

}  // namespace

void validate_schedule_args(ScheduleKind kind, const PipelineShape& shape) {
  validate_counts(shape);
  if (kind != ScheduleKind::interleaved_1f1b) {
    ZS_REQUIRE(shape.virtual_stages == 1, "virtual_stages: got ", shape.virtual_stages,
               ", expected 1 for schedule ", to_string(kind),
               " (only interleaved_1f1b runs several model chunks per rank)");
    return;
  }
  validate_chunks_have_ranks(shape, "schedule interleaved_1f1b");
  // Megatron-LM's order takes micro-batches through the chunks in groups of p. With one chunk
  // per rank there are no groups: the order is 1F1B's, which takes any number (Megatron-LM runs
  // its plain 1F1B when no virtual pipeline size is set, with no such rule).
  if (shape.virtual_stages == 1) return;
  ZS_REQUIRE(shape.num_micro_batches % shape.num_stages == 0,
             "num_micro_batches: got ", shape.num_micro_batches,
             ", expected a multiple of num_stages (", shape.num_stages,
             ") for schedule interleaved_1f1b with virtual_stages ", shape.virtual_stages);
}

MemoryBound memory_bound(ScheduleKind kind, const PipelineShape& shape, int rank) {
  validate_schedule_args(kind, shape);
  ZS_REQUIRE(rank >= 0 && rank < shape.num_stages, "rank: got ", rank, ", expected 0..",
             shape.num_stages - 1, " (num_stages ", shape.num_stages, ")");
  return schedules::memory_bound(kind, shape, rank);
}

std::vector<std::vector<Instruction>> build_all_schedules(ScheduleKind kind,
                                                          const PipelineShape& shape) {
  validate_schedule_args(kind, shape);
  std::vector<PassOrder> orders;
  for (int r = 0; r < shape.num_stages; ++r) orders.push_back(pass_order(kind, shape, r));
  return Placement(shape, std::move(orders), true).run();
}

std::vector<std::vector<Instruction>> build_eval_schedules(const PipelineShape& shape) {
  validate_counts(shape);
  validate_chunks_have_ranks(shape, "eval_batch's lists");
  // The micro-batches run in groups of p through the chunks, a last short group too, so any
  // number of them (training's interleaved order needs a multiple of p).
  const PassOrder order = schedules::forward_only_order(shape);
  return Placement(shape, std::vector<PassOrder>(shape.num_stages, order), false).run();
}

std::vector<Instruction> build_schedule(ScheduleKind kind, const PipelineShape& shape, int rank) {
  validate_schedule_args(kind, shape);
  ZS_REQUIRE(rank >= 0 && rank < shape.num_stages, "rank: got ", rank, ", expected 0..",
             shape.num_stages - 1, " (num_stages ", shape.num_stages, ")");
  return build_all_schedules(kind, shape)[rank];
}

bool is_send(Op op) { return op == Op::send_activation || op == Op::send_gradient; }
bool is_receive(Op op) { return op == Op::receive_activation || op == Op::receive_gradient; }

std::string to_string(Op op) {
  switch (op) {
    case Op::load_micro_batch: return "load_micro_batch";
    case Op::forward: return "forward";
    case Op::backward: return "backward";
    case Op::backward_input: return "backward_input";
    case Op::backward_weight: return "backward_weight";
    case Op::send_activation: return "send_activation";
    case Op::receive_activation: return "receive_activation";
    case Op::send_gradient: return "send_gradient";
    case Op::receive_gradient: return "receive_gradient";
    case Op::reduce_tied: return "reduce_tied";
    case Op::reduce_data_parallel: return "reduce_data_parallel";
    case Op::optimizer_step: return "optimizer_step";
  }
  return "op(" + std::to_string(static_cast<int>(op)) + ")";
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const NamedSchedule& s : kScheduleNames) out.push_back(s.name);
    return out;
  }();
  return names;
}

std::string to_string(ScheduleKind kind) {
  for (const NamedSchedule& s : kScheduleNames)
    if (s.kind == kind) return s.name;
  return "schedule(" + std::to_string(static_cast<int>(kind)) + ")";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  for (const NamedSchedule& s : kScheduleNames)
    if (name == s.name) return s.kind;
  std::string allowed;
  for (const NamedSchedule& s : kScheduleNames)
    allowed += std::string(allowed.empty() ? "" : ", ") + "\"" + s.name + "\"";
  throw UsageError("pipeline.schedule: got \"" + name + "\", expected one of " + allowed);
}

std::string describe(const Instruction& instruction) {
  std::string text = to_string(instruction.op);
  if (instruction.micro_batch != kNone)
    text += " micro-batch " + std::to_string(instruction.micro_batch);
  if (instruction.chunk != kNone) text += " chunk " + std::to_string(instruction.chunk);
  if (is_send(instruction.op)) text += " to rank " + std::to_string(instruction.peer);
  if (is_receive(instruction.op)) text += " from rank " + std::to_string(instruction.peer);
  return text;
}

}  // namespace zeroshard::pipeline

// Validation and simulation of pipeline instruction lists; see schedule_check.h.
#include "pipeline/schedule_check.h"

#include <algorithm>
#include <optional>
#include <string>

#include "runtime/error.h"

namespace zeroshard::pipeline {

namespace {

constexpr Op kTail[] = {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step};
constexpr size_t kTailSize = 3;

bool is_tail(Op op) {
  return op == Op::reduce_tied || op == Op::reduce_data_parallel || op == Op::optimizer_step;
}

bool is_eval_op(Op op) {
  return op == Op::load_micro_batch || op == Op::forward || op == Op::send_activation ||
         op == Op::receive_activation;
}

// What python/zeroshard/pipe/executor.py keeps per (micro-batch, chunk) on a rank, and the rule
// below that has it there before an instruction reads it:
//   batches[mb]    forward on the first / last stage: a load before, the rank's k-th load being
//                  micro-batch k (the executor takes micro-batches from the data iterator in turn)
//   inputs         forward, backward_input (stage > 0): receive_activation before the forward
//   outputs        send_activation, receive_gradient, backward, backward_input: the forward
//                  before each; backward and backward_input drop it, and neither runs before the
//                  gradient, which the next stage sends only after receiving the activation
//   out_grads      backward, backward_input (not the last stage): receive_gradient before
//   in_grads       send_gradient: backward or backward_input before
//   weight_passes  backward_weight: backward_input before

// What has happened to one micro-batch on one global stage.
struct StageMicroBatch {
  bool activation_in = false;
  bool forwarded = false;
  bool gradient_in = false;
  bool input_gradient_done = false;  // backward or backward_input ran
  bool weight_gradient_done = false;
  bool split = false;                // by backward_input, so backward_weight must follow
  bool activation_sent = false;
  bool gradient_sent = false;
};

// What a set of lists is for: a training step's, or eval_batch's forwards only.
enum class Purpose { training, eval };

// eval_batch's bound. Every forward costs the same, so in build_eval_schedules' placement all
// ranks are between passes at once and each output is sent before its rank's next forward: one
// unsent output at a time. A list that holds more (a hand-written one) would keep activations
// alive that eval has no use for.
constexpr int kEvalHeldOutputs = 1;

class Checker {
 public:
  // Without a kind, no memory bound is held; eval's lists are held to kEvalHeldOutputs.
  Checker(Purpose purpose, std::optional<ScheduleKind> kind, const PipelineShape& shape,
          const std::vector<std::vector<Instruction>>& lists, const InstructionCosts& costs)
      : purpose_(purpose), kind_(kind), shape_(shape), lists_(lists), costs_(costs),
        p_(shape.num_stages), last_stage_(shape.num_global_stages() - 1) {
    pc_.assign(p_, 0);
    clock_.assign(p_, 0);
    activations_.assign(p_, 0);
    graphs_.assign(p_, 0);
    loads_.assign(p_, 0);
    if (kind_)
      for (int r = 0; r < p_; ++r) bounds_.push_back(memory_bound(*kind_, shape, r));
    report_.ranks.resize(p_);
    cells_.resize(size_t(shape.num_global_stages()) * shape.num_micro_batches);
  }

  ScheduleReport run() {
    for (int r = 0; r < p_; ++r) check_fields(r);
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < p_; ++r)
        while (step(r)) progress = true;
    }
    report_deadlock();
    check_complete();
    report_.makespan = *std::max_element(clock_.begin(), clock_.end());
    return report_;
  }

 private:
  [[noreturn]] void fail(int rank, size_t index, const std::string& what) const {
    throw UsageError("pipeline schedule check: rank " + std::to_string(rank) + " instruction " +
                     std::to_string(index) + " (" + describe(lists_[rank][index]) + "): " + what);
  }

  StageMicroBatch& cell(int stage, int micro_batch) {
    return cells_[size_t(stage) * shape_.num_micro_batches + micro_batch];
  }

  // The fixed tail (training) and the fields' ranges, before simulating.
  void check_fields(int r) {
    const auto& list = lists_[r];
    size_t body = list.size();
    if (purpose_ == Purpose::training) {
      bool tail_ok = list.size() >= kTailSize;
      body = tail_ok ? list.size() - kTailSize : 0;
      for (size_t k = 0; tail_ok && k < kTailSize; ++k) tail_ok = list[body + k].op == kTail[k];
      if (!tail_ok)
        throw UsageError("pipeline schedule check: rank " + std::to_string(r) +
                         ": the list must end with reduce_tied, reduce_data_parallel, "
                         "optimizer_step");
    }
    for (size_t i = 0; i < body; ++i) {
      const Instruction& in = list[i];
      if (purpose_ == Purpose::eval && !is_eval_op(in.op))
        fail(r, i, "eval_batch runs loads, forwards and activation transfers only");
      if (is_tail(in.op))
        fail(r, i, "reduce_tied, reduce_data_parallel and optimizer_step end the list, once");
      if (in.micro_batch < 0 || in.micro_batch >= shape_.num_micro_batches)
        fail(r, i, "micro_batch must be in 0.." + std::to_string(shape_.num_micro_batches - 1));
      if (in.chunk < 0 || in.chunk >= shape_.virtual_stages)
        fail(r, i, "chunk must be in 0.." + std::to_string(shape_.virtual_stages - 1));
      if ((is_send(in.op) || is_receive(in.op)) && (in.peer < 0 || in.peer >= p_ || in.peer == r))
        fail(r, i, "peer must be another rank in 0.." + std::to_string(p_ - 1));
    }
  }

  // Runs rank r's next instruction if it can; false when finished or blocked.
  bool step(int r) {
    const auto& list = lists_[r];
    if (pc_[r] >= list.size()) return false;
    const Instruction& in = list[pc_[r]];
    if (in.op == Op::reduce_tied) return reduce_tied();
    if (is_send(in.op) || is_receive(in.op)) {
      check_transfer(r, pc_[r]);
      const int peer = in.peer;
      if (pc_[peer] >= lists_[peer].size()) return false;
      const Instruction& other = lists_[peer][pc_[peer]];
      if (!(is_send(other.op) || is_receive(other.op)) || other.peer != r ||
          is_send(other.op) == is_send(in.op))
        return false;  // the peer is not (yet) at a transfer with this rank
      check_transfer(peer, pc_[peer]);
      if (is_send(in.op)) return rendezvous(r, peer);
      return rendezvous(peer, r);
    }
    run_local(r, pc_[r], in);
    clock_[r] += costs_.of(in.op);
    ++pc_[r];
    return true;
  }

  // Treated as a collective of all ranks (tied weights may live on any of them).
  bool reduce_tied() {
    for (int q = 0; q < p_; ++q)
      if (pc_[q] + kTailSize != lists_[q].size()) return false;
    const double now = *std::max_element(clock_.begin(), clock_.end());
    for (int q = 0; q < p_; ++q) {
      clock_[q] = now;
      ++pc_[q];
    }
    return true;
  }

  // The stage a transfer's tensor goes to (sends) or comes from (receives), checked against
  // the stage layout; the transfer's own stage must have the tensor ready to send.
  int transfer_peer_stage(int r, size_t i) const {
    const Instruction& in = lists_[r][i];
    const int stage = shape_.global_stage(r, in.chunk);
    const bool activation = in.op == Op::send_activation || in.op == Op::receive_activation;
    return (activation == is_send(in.op)) ? stage + 1 : stage - 1;
  }

  void check_transfer(int r, size_t i) {
    const Instruction& in = lists_[r][i];
    const int stage = shape_.global_stage(r, in.chunk);
    const int other = transfer_peer_stage(r, i);
    if (other < 0 || other > last_stage_)
      fail(r, i, "stage " + std::to_string(stage) + " has no " +
                     (other < 0 ? "previous" : "next") + " stage to exchange with");
    if (shape_.rank_of(other) != in.peer)
      fail(r, i, "stage " + std::to_string(other) + " is on rank " +
                     std::to_string(shape_.rank_of(other)) + ", not rank " +
                     std::to_string(in.peer));
    const StageMicroBatch& c = cell(stage, in.micro_batch);
    switch (in.op) {
      case Op::send_activation:
        if (!c.forwarded) fail(r, i, "sends an activation before its forward");
        if (c.activation_sent) fail(r, i, "sends the activation twice");
        break;
      case Op::send_gradient:
        if (!c.input_gradient_done) fail(r, i, "sends a gradient before its backward");
        if (c.gradient_sent) fail(r, i, "sends the gradient twice");
        break;
      case Op::receive_activation:
        if (c.activation_in) fail(r, i, "receives the activation twice");
        break;
      default:
        // Else a deadlock (the gradient answers the forward's activation), named here instead.
        if (!c.forwarded)
          fail(r, i, "receives the gradient before its forward on this rank (the executor "
                     "receives into the shapes of the forward's outputs)");
        if (c.gradient_in) fail(r, i, "receives the gradient twice");
    }
  }

  bool rendezvous(int sender, int receiver) {
    const size_t si = pc_[sender], ri = pc_[receiver];
    const Instruction& send = lists_[sender][si];
    const Instruction& receive = lists_[receiver][ri];
    const bool activation = send.op == Op::send_activation;
    const bool same_tensor =
        receive.op == (activation ? Op::receive_activation : Op::receive_gradient) &&
        receive.micro_batch == send.micro_batch &&
        shape_.global_stage(receiver, receive.chunk) == transfer_peer_stage(sender, si);
    if (!same_tensor)
      fail(sender, si, "meets rank " + std::to_string(receiver) + " instruction " +
                           std::to_string(ri) + " (" + describe(receive) +
                           "): sends and receives between two ranks must be in the same order");
    const int from = shape_.global_stage(sender, send.chunk);
    const int to = shape_.global_stage(receiver, receive.chunk);
    if (activation) {
      if (purpose_ == Purpose::eval) --activations_[sender];  // the output is sent on
      cell(from, send.micro_batch).activation_sent = true;
      cell(to, send.micro_batch).activation_in = true;
    } else {
      cell(from, send.micro_batch).gradient_sent = true;
      cell(to, send.micro_batch).gradient_in = true;
    }
    const double done = std::max(clock_[sender], clock_[receiver]) + costs_.of(send.op);
    clock_[sender] = clock_[receiver] = done;
    ++pc_[sender];
    ++pc_[receiver];
    return true;
  }

  // The input a pass needs from a neighbouring stage is there: received, or, when the neighbour
  // is on this rank (one rank, several chunks), computed.
  bool have_activation(int stage, int micro_batch) {
    if (stage == 0) return true;
    if (shape_.rank_of(stage - 1) == shape_.rank_of(stage))
      return cell(stage - 1, micro_batch).forwarded;
    return cell(stage, micro_batch).activation_in;
  }
  bool have_gradient(int stage, int micro_batch) {
    if (stage == last_stage_) return true;
    if (shape_.rank_of(stage + 1) == shape_.rank_of(stage))
      return cell(stage + 1, micro_batch).input_gradient_done;
    return cell(stage, micro_batch).gradient_in;
  }

  void run_local(int r, size_t i, const Instruction& in) {
    if (in.op == Op::reduce_data_parallel || in.op == Op::optimizer_step) return;
    const int stage = shape_.global_stage(r, in.chunk);
    StageMicroBatch& c = cell(stage, in.micro_batch);
    RankReport& rank = report_.ranks[r];
    switch (in.op) {
      case Op::load_micro_batch:
        if (stage != 0 && stage != last_stage_)
          fail(r, i, "stage " + std::to_string(stage) + " is neither the first nor the last");
        // The executor files the data iterator's next micro-batch under the load's: the first
        // and last stages pair inputs with labels only if each rank loads 0, 1, 2, ... once.
        if (in.micro_batch < loads_[r]) fail(r, i, "loads the micro-batch twice on this rank");
        if (in.micro_batch > loads_[r])
          fail(r, i, "loads out of order: expected micro-batch " + std::to_string(loads_[r]) +
                         " (the executor gives each load the data iterator's next micro-batch)");
        ++loads_[r];
        return;
      case Op::forward:
        if (c.forwarded) fail(r, i, "the micro-batch is forwarded twice");
        if ((stage == 0 || stage == last_stage_) && in.micro_batch >= loads_[r])
          fail(r, i, "runs before its micro-batch is loaded");
        if (!have_activation(stage, in.micro_batch))
          fail(r, i, "runs before receiving its activation");
        c.forwarded = true;
        if (purpose_ == Purpose::eval) {
          // An output for a stage on another rank is held until sent; the last stage's is a
          // result, and one for this rank's next chunk is that chunk's input, not held here.
          if (stage != last_stage_ && shape_.rank_of(stage + 1) != r)
            rank.peak_activations = std::max(rank.peak_activations, ++activations_[r]);
          check_eval_bound(r, i);
          break;
        }
        rank.peak_activations = std::max(rank.peak_activations, ++activations_[r]);
        rank.peak_graphs = std::max(rank.peak_graphs, ++graphs_[r]);
        check_bound(r, i);
        break;
      case Op::backward:
      case Op::backward_input:
        if (!c.forwarded) fail(r, i, "runs before its forward");
        if (c.input_gradient_done) fail(r, i, "the micro-batch is backwarded twice");
        if (!have_gradient(stage, in.micro_batch))
          fail(r, i, "runs before receiving its gradient");
        c.input_gradient_done = true;
        c.split = in.op == Op::backward_input;
        c.weight_gradient_done = in.op == Op::backward;
        --activations_[r];
        if (in.op == Op::backward) --graphs_[r];
        break;
      case Op::backward_weight:
        if (!c.split) fail(r, i, "runs without a backward_input before it");
        if (c.weight_gradient_done) fail(r, i, "runs twice");
        c.weight_gradient_done = true;
        --graphs_[r];
        break;
      default:
        ZS_CHECK(false, "run_local got ", describe(in));
    }
    rank.busy_time += costs_.of(in.op);
  }

  // After forward i on rank r: what it holds now against its schedule's bound.
  void check_bound(int r, size_t i) const {
    if (!kind_) return;
    const MemoryBound& bound = bounds_[r];
    const std::string where = " (p " + std::to_string(p_) + ", m " +
                              std::to_string(shape_.num_micro_batches) + ", v " +
                              std::to_string(shape_.virtual_stages) + ")";
    if (activations_[r] > bound.activations)
      fail(r, i, "rank " + std::to_string(r) + " holds " + std::to_string(activations_[r]) +
                     " activations (forwards whose backward has not run), above schedule " +
                     to_string(*kind_) + "'s bound of " + std::to_string(bound.activations) +
                     where);
    if (graphs_[r] > bound.graphs)
      fail(r, i, "rank " + std::to_string(r) + " holds " + std::to_string(graphs_[r]) +
                     " autograd graphs (forwards whose weight gradient has not run), above "
                     "schedule " + to_string(*kind_) + "'s bound of " +
                     std::to_string(bound.graphs) + where);
  }

  void check_eval_bound(int r, size_t i) const {
    if (activations_[r] > kEvalHeldOutputs)
      fail(r, i, "rank " + std::to_string(r) + " holds " + std::to_string(activations_[r]) +
                     " forward outputs not yet sent, above eval_batch's bound of " +
                     std::to_string(kEvalHeldOutputs));
  }

  std::string waiting_for(int r) const {
    const Instruction& in = lists_[r][pc_[r]];
    if (in.op == Op::reduce_tied) return "waits for every rank to reach reduce_tied";
    const std::string peer = "rank " + std::to_string(in.peer);
    if (pc_[in.peer] >= lists_[in.peer].size()) return "waits for " + peer + ", which has finished";
    return "waits for " + peer + (is_send(in.op) ? " to receive it" : " to send it");
  }

  void report_deadlock() const {
    std::string blocked;
    for (int r = 0; r < p_; ++r) {
      if (pc_[r] >= lists_[r].size()) continue;
      if (!blocked.empty()) blocked += "; ";
      blocked += "rank " + std::to_string(r) + " at instruction " + std::to_string(pc_[r]) +
                 " (" + describe(lists_[r][pc_[r]]) + ") " + waiting_for(r);
    }
    if (!blocked.empty()) throw UsageError("pipeline schedule check: deadlock: " + blocked);
  }

  // After a run without deadlock: every micro-batch went through every stage.
  void check_complete() {
    const bool training = purpose_ == Purpose::training;
    for (int stage = 0; stage <= last_stage_; ++stage) {
      const int rank = shape_.rank_of(stage);
      const bool next_elsewhere = stage < last_stage_ && shape_.rank_of(stage + 1) != rank;
      const bool previous_elsewhere = stage > 0 && shape_.rank_of(stage - 1) != rank;
      for (int mb = 0; mb < shape_.num_micro_batches; ++mb) {
        const StageMicroBatch& c = cell(stage, mb);
        const char* missing = !c.forwarded                             ? "forward"
                              : training && !c.input_gradient_done     ? "backward"
                              : training && !c.weight_gradient_done    ? "backward_weight"
                              : next_elsewhere && !c.activation_sent   ? "send_activation"
                              : training && previous_elsewhere && !c.gradient_sent ? "send_gradient"
                                                                         : nullptr;
        if (missing)
          throw UsageError("pipeline schedule check: rank " + std::to_string(rank) + " chunk " +
                           std::to_string(shape_.chunk_of(stage)) + " micro-batch " +
                           std::to_string(mb) + ": no " + missing);
      }
    }
  }

  const Purpose purpose_;
  const std::optional<ScheduleKind> kind_;
  const PipelineShape shape_;
  const std::vector<std::vector<Instruction>>& lists_;
  const InstructionCosts costs_;
  const int p_;
  const int last_stage_;
  std::vector<size_t> pc_;        // per rank: next instruction
  std::vector<double> clock_;     // per rank: simulated time
  std::vector<int> activations_;  // per rank: held now (RankReport's peak_activations)
  std::vector<int> graphs_;       // per rank: held now (RankReport's peak_graphs)
  std::vector<int> loads_;        // per rank: loads so far
  std::vector<MemoryBound> bounds_;     // per rank, with a kind
  std::vector<StageMicroBatch> cells_;  // per (global stage, micro-batch)
  ScheduleReport report_;
};

}  // namespace

double ScheduleReport::bubble_fraction() const {
  if (makespan <= 0 || ranks.empty()) return 0;
  double busy = 0;
  for (const RankReport& rank : ranks) busy += rank.busy_time;
  return 1 - busy / (double(ranks.size()) * makespan);
}

namespace {

ScheduleReport run_checker(Purpose purpose, std::optional<ScheduleKind> kind,
                           const PipelineShape& shape,
                           const std::vector<std::vector<Instruction>>& lists,
                           const InstructionCosts& costs) {
  ZS_REQUIRE(shape.num_stages >= 1 && shape.num_micro_batches >= 1 && shape.virtual_stages >= 1,
             "pipeline schedule check: num_stages, num_micro_batches and virtual_stages must be "
             ">= 1, got ", shape.num_stages, ", ", shape.num_micro_batches, ", ",
             shape.virtual_stages);
  ZS_REQUIRE(int(lists.size()) == shape.num_stages, "pipeline schedule check: got ",
             lists.size(), " lists, expected one per rank (num_stages ", shape.num_stages, ")");
  return Checker(purpose, kind, shape, lists, costs).run();
}

}  // namespace

ScheduleReport simulate_schedule(const PipelineShape& shape,
                                 const std::vector<std::vector<Instruction>>& lists,
                                 const InstructionCosts& costs) {
  return run_checker(Purpose::training, std::nullopt, shape, lists, costs);
}

ScheduleReport check_schedule(ScheduleKind kind, const PipelineShape& shape,
                              const std::vector<std::vector<Instruction>>& lists,
                              const InstructionCosts& costs) {
  return run_checker(Purpose::training, kind, shape, lists, costs);
}

ScheduleReport check_eval_schedule(const PipelineShape& shape,
                                   const std::vector<std::vector<Instruction>>& lists,
                                   const InstructionCosts& costs) {
  return run_checker(Purpose::eval, std::nullopt, shape, lists, costs);
}

}  // namespace zeroshard::pipeline

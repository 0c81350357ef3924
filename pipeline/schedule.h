// Pipeline schedules as data: for (schedule, stages, micro-batches, model chunks, rank) the list of
// instructions that rank runs in one training step. The Python engine executes a list; the checker
// (schedule_check.h) proves a set of lists runnable first. Pure C++, no Torch.
#pragma once
#include <string>
#include <vector>

namespace zeroshard::pipeline {

enum class Op {
  load_micro_batch,      // first stage: the inputs; last stage: the labels
  forward,
  backward,              // input and weight gradients together
  backward_input,        // gradient of the stage's input only (zero_bubble's B)
  backward_weight,       // gradient of the stage's weights only (zero_bubble's W)
  send_activation,
  receive_activation,
  send_gradient,
  receive_gradient,
  reduce_tied,           // all-reduce the gradients of weights tied across stages
  reduce_data_parallel,  // reduce gradients across data-parallel replicas of this stage
  optimizer_step,
};

constexpr int kNone = -1;  // a field an instruction does not have

struct Instruction {
  Op op;
  int micro_batch = kNone;  // 0..m-1; kNone for the final three
  int chunk = kNone;        // model chunk on this rank, 0..v-1; kNone for the final three
  int peer = kNone;         // pipeline rank at the other end of a send / receive
  // A send matches the receive with the same tensor (activation or gradient), micro-batch and
  // the neighbouring global stage: chunk c of the last rank sends to chunk c + 1 of rank 0.
  bool operator==(const Instruction& o) const {
    return op == o.op && micro_batch == o.micro_batch && chunk == o.chunk && peer == o.peer;
  }
};

enum class ScheduleKind {
  gpipe,             // all forwards, then all backwards
  one_f_one_b,       // DeepSpeed's TrainSchedule: warm-up forwards, steady 1F1B, cool-down
  interleaved_1f1b,  // Megatron-LM's: v model chunks per rank, chunk c of rank r is stage c*p + r
  zero_bubble,       // ZB-H1 (Qi et al. 2023): backward split into B and W, W fills the bubble
};

// Pipeline ranks, micro-batches per step and model chunks per rank. Global stage s (0..p*v-1)
// lives on rank s % p as chunk s / p, so activations visit every rank once per chunk.
struct PipelineShape {
  int num_stages = 1;         // p: pipeline ranks (DeepSpeed's num_stages)
  int num_micro_batches = 1;  // m: gradient_accumulation_steps
  int virtual_stages = 1;     // v: model chunks per rank (interleaved_1f1b only)

  int num_global_stages() const { return num_stages * virtual_stages; }
  int global_stage(int rank, int chunk) const { return chunk * num_stages + rank; }
  int rank_of(int global_stage) const { return global_stage % num_stages; }
  int chunk_of(int global_stage) const { return global_stage / num_stages; }
};

// Durations used to simulate a schedule. The defaults are the unit costs the papers' bubble
// formulas assume (a whole backward costs a forward plus a weight pass); the benchmark passes
// measured ones instead.
struct InstructionCosts {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  double backward = 2;
  double communication = 0;  // a send / receive pair, once both sides are there
  double of(Op op) const;    // 0 for loads and the final three
};

// Throws UsageError naming the argument, its value and what is allowed. The one place that
// decides which shapes a schedule runs: v > 1 only for interleaved_1f1b and only with p > 1, and
// there m a multiple of p (v = 1 is 1F1B's order, any m).
void validate_schedule_args(ScheduleKind kind, const PipelineShape& shape);

// The most one rank holds at once under a schedule, from the schedule's own order (one function
// per schedule in schedules/): the bound check_schedule proves and Catch2 shows reached.
struct MemoryBound {
  int activations;  // chunk-forwards whose backward (or backward_input) has not run
  // Chunk-forwards whose weight gradient has not run. zero_bubble's B leaves the autograd graph,
  // and the activations it saved, to W; the other schedules free both at backward (= activations).
  int graphs;
};
MemoryBound memory_bound(ScheduleKind kind, const PipelineShape& shape, int rank);

// Rank `rank`'s instructions for one step, ending with reduce_tied, reduce_data_parallel,
// optimizer_step. Builds every rank's list (a rank's sends are placed against its neighbours'
// receives), so building all ranks at once is cheaper with build_all_schedules.
std::vector<Instruction> build_schedule(ScheduleKind kind, const PipelineShape& shape, int rank);
std::vector<std::vector<Instruction>> build_all_schedules(ScheduleKind kind,
                                                          const PipelineShape& shape);

// eval_batch's lists: every rank's loads, activation receives, forwards and activation sends
// for `shape`'s micro-batches, with no backward and no reductions after them, placed as a
// training schedule's are. Any number of micro-batches; v > 1 needs p > 1, as in training.
// check_eval_schedule (schedule_check.h) proves them runnable.
std::vector<std::vector<Instruction>> build_eval_schedules(const PipelineShape& shape);

bool is_send(Op op);
bool is_receive(Op op);
std::string to_string(Op op);
// The schedules' names as pipeline.schedule spells them, in ScheduleKind's order: the one list.
// runtime/config repeats it (it sits below pipeline/ and cannot include this header);
// tests/cpp/pipeline/test_schedule.cpp fails when the two differ.
const std::vector<std::string>& schedule_names();
std::string to_string(ScheduleKind kind);  // its name in schedule_names()
// Throws UsageError: pipeline.schedule: got "x", expected one of "gpipe", "1f1b", ...
ScheduleKind parse_schedule_kind(const std::string& name);
// "send_activation micro-batch 2 chunk 0 to rank 1", for error messages.
std::string describe(const Instruction& instruction);

}  // namespace zeroshard::pipeline

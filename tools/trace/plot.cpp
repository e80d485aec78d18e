#include "tools/trace/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "tensor/error.h"
#include "tools/trace/report.h"

#ifdef DG_HAVE_CAIRO
#include <cairo-svg.h>
#include <cairo.h>
#endif

namespace distgrad::tools::trace {

std::array<double, 3> boxColour(BoxKind kind, int64_t microBatch, const std::string& category) {
  const bool odd = microBatch >= 0 && microBatch % 2 == 1;
  switch (kind) {
    case BoxKind::kForward:
      return odd ? std::array<double, 3>{0.40, 0.62, 0.85} : std::array<double, 3>{0.12, 0.38, 0.70};
    case BoxKind::kBackward:
      return odd ? std::array<double, 3>{0.98, 0.70, 0.40} : std::array<double, 3>{0.90, 0.45, 0.10};
    case BoxKind::kOptimizer: return {0.20, 0.63, 0.17};
    case BoxKind::kSpan: break;
  }
  static const std::map<std::string, std::array<double, 3>, std::less<>> kByCategory = {
      {"user", {0.55, 0.34, 0.29}},      {"rpc_client", {0.58, 0.40, 0.74}}, {"rpc_server", {0.84, 0.15, 0.16}},
      {"transport", {0.50, 0.50, 0.50}}, {"rref", {0.74, 0.74, 0.13}},       {"autograd", {0.09, 0.75, 0.81}},
      {"optimizer", {0.20, 0.63, 0.17}}, {"pipeline", {0.12, 0.38, 0.70}},
  };
  auto it = kByCategory.find(category);
  return it == kByCategory.end() ? std::array<double, 3>{0.7, 0.7, 0.7} : it->second;
}

namespace {

PlotLayout pipelineLayout(const TraceSet& set, const PipelineAnalysis& p, const PlotOptions& options) {
  PlotLayout layout;
  layout.pipeline = true;
  int64_t originNs = 0, endNs = 0;
  std::optional<int64_t> step;
  if (!options.allSteps && !p.steps.empty()) {
    if (options.step) {
      auto it =
          std::find_if(p.steps.begin(), p.steps.end(), [&](const StepAnalysis& s) { return s.step == *options.step; });
      if (it == p.steps.end()) {
        std::string known;
        for (const auto& s : p.steps) known += (known.empty() ? "" : ", ") + std::to_string(s.step);
        throw ValueError("step " + std::to_string(*options.step) + " is not in the trace (steps: " + known + ")");
      }
      step = it->step;
      originNs = it->beginNs;
      endNs = it->endNs;
    } else {
      step = p.steps.back().step;
      originNs = p.steps.back().beginNs;
      endNs = p.steps.back().endNs;
    }
  } else if (options.step && !options.allSteps) {
    throw ValueError("--step needs pipeline.step spans, and the trace has none");
  }
  std::vector<const PipelineOp*> ops;
  for (const auto& op : p.ops) {
    if (!step || op.step == *step) ops.push_back(&op);
  }
  if (ops.empty()) throw ValueError("no pipeline forward/backward spans to draw");
  if (!step) {
    originNs = ops.front()->beginNs;
    endNs = originNs;
    for (const auto& s : p.steps) {
      originNs = std::min(originNs, s.beginNs);
      endNs = std::max(endNs, s.endNs);
    }
  }
  int64_t stages = p.stages;
  // Ops outside the step's shape were reported by the analysis; without a step span the ops say how many
  // stages there are, within the same bound.
  ops.erase(std::remove_if(ops.begin(), ops.end(),
                           [&](const PipelineOp* op) {
                             return op->stage < 0 || op->stage >= (p.present ? p.stages : kMaxPipelineStages);
                           }),
            ops.end());
  if (ops.empty()) throw ValueError("no pipeline forward/backward spans of a valid stage to draw");
  for (const PipelineOp* op : ops) {
    originNs = std::min(originNs, op->beginNs);
    endNs = std::max(endNs, op->endNs);
    stages = std::max(stages, op->stage + 1);
  }
  std::map<int64_t, std::string> workerOfStage;
  for (const auto& s : p.stageSummaries) workerOfStage[s.stage] = s.worker;
  for (const PipelineOp* op : ops) workerOfStage.emplace(op->stage, set.workers[op->worker].worker);
  for (int64_t s = 0; s < stages; ++s) {
    std::string row = "stage " + std::to_string(s);
    if (auto it = workerOfStage.find(s); it != workerOfStage.end() && !it->second.empty())
      row += " (" + it->second + ")";
    layout.rows.push_back(row);
  }
  for (const PipelineOp* op : ops) {
    PlotBox box;
    box.row = static_cast<int>(op->stage);
    box.beginMs = static_cast<double>(op->beginNs - originNs) / 1e6;
    box.endMs = static_cast<double>(op->endNs - originNs) / 1e6;
    box.microBatch = op->microBatch;
    switch (op->kind) {
      case PipelineOp::Kind::kForward:
        box.kind = BoxKind::kForward;
        box.label = std::to_string(op->microBatch);
        break;
      case PipelineOp::Kind::kBackward:
        box.kind = BoxKind::kBackward;
        box.label = std::to_string(op->microBatch);
        break;
      case PipelineOp::Kind::kOptimizer:
        box.kind = BoxKind::kOptimizer;
        box.label = "opt";
        break;
    }
    layout.boxes.push_back(box);
  }
  for (const auto& s : p.steps) {
    if (!step || s.step == *step) {
      layout.markers.push_back({static_cast<double>(s.beginNs - originNs) / 1e6, "step " + std::to_string(s.step)});
    }
  }
  layout.spanMs = static_cast<double>(endNs - originNs) / 1e6;
  layout.title = std::string(p.rpc ? "RPC" : "local") + " pipeline, " + (p.schedule.empty() ? "?" : p.schedule) + ", " +
                 std::to_string(stages) + " stages, " + std::to_string(p.microBatches) + " micro-batches, " +
                 (step ? "step " + std::to_string(*step) : std::string("all steps"));
  for (const auto& s : p.steps) {
    if (step && s.step == *step) {
      char buf[96];
      std::snprintf(buf, sizeof buf, ": %.3f ms (ideal %.3f ms)", s.wallMs, s.idealMs);
      layout.title += buf;
    }
  }
  return layout;
}

PlotLayout spanLayout(const TraceSet& set) {
  PlotLayout layout;
  int64_t endNs = set.originNs;
  for (const auto& w : set.workers) {
    std::map<int64_t, std::vector<const Event*>> byThread;
    for (const auto& ev : w.events) {
      if (ev.kind == EventKind::kSpan) byThread[ev.tid].push_back(&ev);
    }
    for (auto& [tid, spans] : byThread) {
      std::sort(spans.begin(), spans.end(),
                [](const Event* a, const Event* b) { return a->b != b->b ? a->b < b->b : a->e > b->e; });
      const int row = static_cast<int>(layout.rows.size());
      layout.rows.push_back(w.worker + " / " + w.threadName(tid));
      int64_t covered = std::numeric_limits<int64_t>::min();
      for (const Event* ev : spans) {
        if (ev->b < covered) continue;  // nested in the previous outermost span
        covered = ev->e;
        PlotBox box;
        box.row = row;
        box.beginMs = static_cast<double>(ev->b - set.originNs) / 1e6;
        box.endMs = static_cast<double>(ev->e - set.originNs) / 1e6;
        box.kind = BoxKind::kSpan;
        box.label = ev->name;
        box.category = ev->cat;
        layout.boxes.push_back(box);
        endNs = std::max(endNs, ev->e);
      }
    }
  }
  if (layout.boxes.empty()) throw ValueError("the trace has no spans to draw");
  layout.spanMs = static_cast<double>(endNs - set.originNs) / 1e6;
  layout.title = "distgrad trace: " + std::to_string(set.workers.size()) + " worker(s), outermost spans per thread";
  return layout;
}

}  // namespace

PlotLayout layoutPlot(const TraceSet& set, const PlotOptions& options) {
  PipelineAnalysis p = analyzePipeline(set, nullptr);
  if (!p.ops.empty()) return pipelineLayout(set, p, options);
  if (options.step) throw ValueError("--step needs pipeline events, and the trace has none");
  return spanLayout(set);
}

#ifndef DG_HAVE_CAIRO

bool plotSupported() { return false; }

void renderPlot(const PlotLayout&, const std::string&, int) {
  throw ValueError(
      "distgrad-trace was built without cairo, so it cannot draw (install libcairo2-dev, e.g. scripts/deps.sh, and "
      "re-run cmake)");
}

#else

bool plotSupported() { return true; }

namespace {

constexpr double kLeft = 190, kRight = 30, kTop = 56, kRowHeight = 34, kRowGap = 8, kAxis = 44, kLegend = 40;

// A tick step of 1, 2 or 5 times a power of ten giving about `target` ticks.
double tickStep(double span, int target) {
  if (span <= 0) return 1;
  const double raw = span / target;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

void setColour(cairo_t* cr, const std::array<double, 3>& c) { cairo_set_source_rgb(cr, c[0], c[1], c[2]); }

void draw(cairo_t* cr, const PlotLayout& layout, double width, double height) {
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);

  cairo_set_source_rgb(cr, 0, 0, 0);
  cairo_set_font_size(cr, 15);
  cairo_move_to(cr, 12, 26);
  cairo_show_text(cr, layout.title.c_str());

  const double plotWidth = width - kLeft - kRight;
  const double span = layout.spanMs > 0 ? layout.spanMs : 1.0;
  auto x = [&](double ms) { return kLeft + plotWidth * ms / span; };
  const double rowsBottom = kTop + static_cast<double>(layout.rows.size()) * (kRowHeight + kRowGap);

  // Rows: a light band and the row's name.
  cairo_set_font_size(cr, 12);
  for (size_t r = 0; r < layout.rows.size(); ++r) {
    const double y = kTop + static_cast<double>(r) * (kRowHeight + kRowGap);
    cairo_set_source_rgb(cr, 0.95, 0.95, 0.95);
    cairo_rectangle(cr, kLeft, y, plotWidth, kRowHeight);
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_text_extents_t ext;
    cairo_text_extents(cr, layout.rows[r].c_str(), &ext);
    cairo_move_to(cr, std::max(4.0, kLeft - 8 - ext.x_advance), y + kRowHeight / 2 + 4);
    cairo_show_text(cr, layout.rows[r].c_str());
  }

  // Time axis: grid lines and labels in ms.
  const double step = tickStep(span, 10);
  cairo_set_line_width(cr, 0.5);
  cairo_set_font_size(cr, 11);
  for (double t = 0; t <= span + step * 1e-9; t += step) {
    const double px = x(t);
    cairo_set_source_rgb(cr, 0.75, 0.75, 0.75);
    cairo_move_to(cr, px, kTop - 4);
    cairo_line_to(cr, px, rowsBottom + 4);
    cairo_stroke(cr);
    char label[32];
    std::snprintf(label, sizeof label, step >= 1 ? "%.0f" : (step >= 0.1 ? "%.1f" : "%.3g"), t);
    cairo_text_extents_t ext;
    cairo_text_extents(cr, label, &ext);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_move_to(cr, px - ext.x_advance / 2, rowsBottom + 18);
    cairo_show_text(cr, label);
  }
  cairo_move_to(cr, kLeft + plotWidth / 2 - 20, rowsBottom + 36);
  cairo_show_text(cr, "time (ms)");

  // Step starts: dashed lines across the rows, labelled above them.
  cairo_set_font_size(cr, 10);
  for (const auto& [ms, label] : layout.markers) {
    const double px = x(ms);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    const double dash[] = {4.0, 3.0};
    cairo_set_dash(cr, dash, 2, 0);
    cairo_set_line_width(cr, 1.0);
    cairo_move_to(cr, px, kTop - 12);
    cairo_line_to(cr, px, rowsBottom);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    cairo_move_to(cr, px + 3, kTop - 6);
    cairo_show_text(cr, label.c_str());
  }

  // Boxes, labelled when the label fits.
  cairo_set_font_size(cr, 11);
  for (const PlotBox& box : layout.boxes) {
    const double y = kTop + box.row * (kRowHeight + kRowGap);
    const double x0 = x(box.beginMs);
    const double w = std::max(0.5, x(box.endMs) - x0);
    setColour(cr, boxColour(box.kind, box.microBatch, box.category));
    cairo_rectangle(cr, x0, y + 2, w, kRowHeight - 4);
    cairo_fill(cr);
    if (!box.label.empty()) {
      cairo_text_extents_t ext;
      cairo_text_extents(cr, box.label.c_str(), &ext);
      if (ext.x_advance + 4 <= w) {
        cairo_set_source_rgb(cr, 1, 1, 1);
        cairo_move_to(cr, x0 + (w - ext.x_advance) / 2, y + kRowHeight / 2 + 4);
        cairo_show_text(cr, box.label.c_str());
      }
    }
  }

  // Legend.
  std::vector<std::pair<std::string, std::array<double, 3>>> entries;
  if (layout.pipeline) {
    entries = {{"forward (micro-batch number)", boxColour(BoxKind::kForward, 0, "")},
               {"backward", boxColour(BoxKind::kBackward, 0, "")},
               {"optimizer", boxColour(BoxKind::kOptimizer, -1, "")}};
  } else {
    std::map<std::string, int> seen;
    for (const PlotBox& box : layout.boxes) seen.emplace(box.category, 0);
    for (const auto& [cat, unused] : seen) entries.push_back({cat, boxColour(BoxKind::kSpan, -1, cat)});
  }
  double lx = kLeft;
  const double ly = height - kLegend + 8;
  for (const auto& [name, colour] : entries) {
    setColour(cr, colour);
    cairo_rectangle(cr, lx, ly, 16, 14);
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_move_to(cr, lx + 22, ly + 11);
    cairo_show_text(cr, name.c_str());
    cairo_text_extents_t ext;
    cairo_text_extents(cr, name.c_str(), &ext);
    lx += 22 + ext.x_advance + 24;
  }
}

}  // namespace

void renderPlot(const PlotLayout& layout, const std::string& path, int width) {
  const bool svg = path.size() >= 4 && path.compare(path.size() - 4, 4, ".svg") == 0;
  const bool png = path.size() >= 4 && path.compare(path.size() - 4, 4, ".png") == 0;
  if (!svg && !png) throw ValueError(path + ": the output must end in .svg or .png");
  if (width < 400 || width > 20000)
    throw ValueError("plot width must be in [400, 20000], got " + std::to_string(width));
  const double w = width;
  const double h = kTop + static_cast<double>(layout.rows.size()) * (kRowHeight + kRowGap) + kAxis + kLegend;
  cairo_surface_t* surface =
      svg ? cairo_svg_surface_create(path.c_str(), w, h)
          : cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, static_cast<int>(std::ceil(h)));
  if (cairo_surface_status(surface) != CAIRO_STATUS_SUCCESS) {
    const std::string why = cairo_status_to_string(cairo_surface_status(surface));
    cairo_surface_destroy(surface);
    throw ValueError(path + ": cannot create the picture: " + why);
  }
  cairo_t* cr = cairo_create(surface);
  draw(cr, layout, w, h);
  cairo_status_t status = cairo_status(cr);
  cairo_destroy(cr);
  if (status == CAIRO_STATUS_SUCCESS && png) status = cairo_surface_write_to_png(surface, path.c_str());
  cairo_surface_finish(surface);  // an SVG surface writes its file here
  if (status == CAIRO_STATUS_SUCCESS) status = cairo_surface_status(surface);
  cairo_surface_destroy(surface);
  if (status != CAIRO_STATUS_SUCCESS)
    throw ValueError(path + ": cannot write the picture: " + cairo_status_to_string(status));
}

#endif

}  // namespace distgrad::tools::trace

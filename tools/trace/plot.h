// distgrad-trace plot: the picture of a pipeline step (stages as rows, each micro-batch's forward and
// backward as a box labelled with its number, forward in blues and backward in oranges, optimizer steps in
// green, a time axis in ms and a legend), drawn with cairo to SVG or PNG. Without pipeline events it draws
// every worker's threads as rows and their outermost spans as boxes coloured by category.
//
// layoutPlot() computes what is drawn (rows and boxes in ms from the picture's origin) without cairo, so
// tests check the geometry; renderPlot() draws a layout. A build without cairo (pkg-config found none at
// configure time) still has layoutPlot; renderPlot then throws a ValueError saying so.
// Thread-safety: pure functions (renderPlot writes its file).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tools/trace/trace_data.h"

namespace distgrad::tools::trace {

enum class BoxKind { kForward, kBackward, kOptimizer, kSpan };

struct PlotBox {
  int row = 0;
  double beginMs = 0, endMs = 0;  // from the layout's origin
  BoxKind kind = BoxKind::kSpan;
  int64_t microBatch = -1;  // forward / backward
  std::string label;        // drawn inside when it fits
  std::string category;     // kSpan: the span's cat (picks the colour)
};

struct PlotLayout {
  std::string title;
  std::vector<std::string> rows;
  std::vector<PlotBox> boxes;
  std::vector<std::pair<double, std::string>> markers;  // labelled vertical lines (each step's start)
  double spanMs = 0;                                    // the time axis covers [0, spanMs]
  bool pipeline = false;
};

struct PlotOptions {
  std::optional<int64_t> step;  // a pipeline step; none: the last one
  bool allSteps = false;        // every step (overrides step)
  int width = 1400;             // pixels (PNG) / points (SVG)
};

// ValueError when the chosen step has no pipeline.step span or the trace has nothing to draw.
PlotLayout layoutPlot(const TraceSet& set, const PlotOptions& options);

// The fill colour (r, g, b in [0, 1]) of a box: forward boxes alternate two blues and backward boxes two
// oranges by micro-batch parity (so neighbours stay apart), optimizer boxes are green, spans are coloured
// by category. The legend's swatches use micro-batch 0's colours.
std::array<double, 3> boxColour(BoxKind kind, int64_t microBatch, const std::string& category);

// True when this build has cairo.
bool plotSupported();

// Draws `layout` to `path`, ".svg" or ".png" (ValueError for any other extension, for a file that cannot be
// written, and when the build has no cairo).
void renderPlot(const PlotLayout& layout, const std::string& path, int width = 1400);

}  // namespace distgrad::tools::trace

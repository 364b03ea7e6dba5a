#include "testing/trace_reader.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <sstream>
#include <thread>

namespace cp::testing {

namespace {

template <typename Key>
std::string counted(const std::map<Key, int>& values) {
  std::ostringstream out;
  for (const auto& [value, count] : values)
    out << (out.tellp() > 0 ? ", " : "") << value << " (" << count << (count == 1 ? " span)" : " spans)");
  return out.tellp() > 0 ? out.str() : "none";
}

}  // namespace

std::string TraceContents::describe() const {
  return "lanes seen: " + counted(spans_per_lane) + "; ranks seen: " + counted(spans_per_rank);
}

TraceContents read_trace(const Trace& trace) {
  // One file per process and thread: under mpirun every rank runs the test, and the ranks of a
  // local world are threads of one process.
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("cp_trace_" + std::to_string(::getpid()) + "_" +
       std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())) + ".json");
  trace.write(path.string());
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  std::filesystem::remove(path);

  TraceContents contents;
  contents.has_trace_events = json.find("\"traceEvents\"") != std::string::npos;
  // A span is one line: {"name": ..., "cat": "<lane>", "ph": "X", "pid": <rank>, ...}.
  const std::regex span("\"cat\": \"([^\"]*)\", \"ph\": \"X\", \"pid\": ([0-9]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), span); it != std::sregex_iterator(); ++it) {
    ++contents.spans_per_lane[(*it)[1].str()];
    ++contents.spans_per_rank[std::stoi((*it)[2].str())];
  }
  return contents;
}

}  // namespace cp::testing

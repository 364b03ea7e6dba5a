#include "common/cli.h"

#include <cstdio>

#include "common/error.h"

namespace cp {

CommandLine::CommandLine(int argc, char** argv, std::string program_help, std::vector<Option> options)
    : options_(std::move(options)) {
  for (const Option& o : options_) values_[o.name] = o.default_value;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      std::printf("%s\n\noptions:\n", program_help.c_str());
      for (const Option& o : options_)
        std::printf("  %-12s %s%s\n", o.name.c_str(), o.help.c_str(),
                    o.default_value.empty() ? "" : (" (default " + o.default_value + ")").c_str());
      return;
    }
    CP_CHECK(values_.count(arg), "unknown option '", arg, "' (try --help)");
    CP_CHECK(i + 1 < argc, "option ", arg, " needs a value");
    values_[arg] = argv[++i];
  }
}

std::string CommandLine::get(const std::string& name) const {
  const auto it = values_.find(name);
  CP_CHECK(it != values_.end(), "no option ", name);
  return it->second;
}

int CommandLine::get_int(const std::string& name) const {
  const std::string text = get(name);
  try {
    size_t used = 0;
    const int value = std::stoi(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  CP_FAIL(name, ": expected an integer, got '", text, "'");
}

c10::ScalarType parse_dtype(const std::string& name, const std::string& option) {
  if (name == "float32") return c10::kFloat;
  if (name == "float64") return c10::kDouble;
  if (name == "float16") return c10::kHalf;
  if (name == "bfloat16") return c10::kBFloat16;
  CP_FAIL(option, ": expected float32, float64, float16 or bfloat16, got '", name, "'");
}

}  // namespace cp

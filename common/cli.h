// Command-line options of the demos and benchmarks: `--name value` pairs with defaults and a
// --help that lists them. Unknown options are a cp::Error naming them.
#pragma once

#include <c10/core/ScalarType.h>

#include <map>
#include <string>
#include <vector>

namespace cp {

class CommandLine {
 public:
  struct Option {
    std::string name;           ///< e.g. "--world"
    std::string default_value;  ///< "" for none
    std::string help;
  };

  /// Parses argv against `options`; --help prints them and sets help_requested().
  CommandLine(int argc, char** argv, std::string program_help, std::vector<Option> options);

  bool help_requested() const { return help_; }
  std::string get(const std::string& name) const;
  int get_int(const std::string& name) const;

 private:
  std::vector<Option> options_;
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

/// "float32", "float64", "float16" or "bfloat16" as a dtype; anything else is a cp::Error naming
/// `option` (e.g. "--dtype").
c10::ScalarType parse_dtype(const std::string& name, const std::string& option);

}  // namespace cp

// The host harness's driver: reads a command per line and runs the FK_HOST_COMMAND of that name
// (harness.h; each tests/cuda_host/<op>.cpp adds its op's commands).
#include "harness.h"

#include <map>

static std::map<std::string, HostCommand>& commands() {
  static std::map<std::string, HostCommand> table;
  return table;
}

bool add_host_command(const char* name, HostCommand fn) {
  if (!commands().emplace(name, fn).second) {
    std::fprintf(stderr, "host harness: command %s defined twice\n", name);
    std::exit(2);
  }
  return true;
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd.empty()) continue;
    const auto it = commands().find(cmd);
    if (it == commands().end()) {
      std::printf("ERR unknown command %s\n", cmd.c_str());
    } else {
      it->second(in);
    }
    std::fflush(stdout);
  }
  return 0;
}

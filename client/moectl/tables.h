// Text renderings of cluster state for moectl and the demo: the cluster map and the per-layer load
// table. Pure functions of their inputs.
#ifndef MOE_CLIENT_MOECTL_TABLES_H_
#define MOE_CLIENT_MOECTL_TABLES_H_

#include <string>

#include "moe/v1/coordinator.pb.h"
#include "moe/v1/shard.pb.h"

namespace moe {

std::string FormatClusterMap(const v1::ClusterMap& map);
std::string FormatLoadTable(const v1::LoadStats& stats);
std::string FormatShardInfo(const v1::ShardInfo& info);

}  // namespace moe

#endif  // MOE_CLIENT_MOECTL_TABLES_H_

variable "run_id" {
  type        = number
  description = "Oolong run id; names every resource of the run."
}

variable "region" {
  type        = string
  description = "Cloud region."
}

variable "availability_zone" {
  type        = string
  description = "Zone for the run's nodes."
}

variable "instance_type" {
  type        = string
  description = "GPU instance type."
}

variable "node_count" {
  type        = number
  description = "Number of GPU nodes for the run."
}

variable "disk_size_gb" {
  type        = number
  description = "Root disk per node in GB."
  default     = 200
}

variable "spot" {
  type        = bool
  description = "Spot instead of on-demand."
  default     = false
}

variable "prefect_api_url" {
  type        = string
  description = "Prefect server API the nodes' workers join."

  validation {
    # It is written into cloud-init, which runs as root: no whitespace, quotes or expansions.
    condition     = can(regex("^https?://[^\\s\"'`$\\\\]+$", var.prefect_api_url))
    error_message = "prefect_api_url must be an http(s) URL without whitespace, quotes or $."
  }
}

variable "control_plane_cidrs" {
  type        = list(string)
  description = "Control plane networks allowed on the rollout port."
  default     = []
}

variable "control_plane_vpc_id" {
  type        = string
  description = "The control plane's VPC, peered with the run's (empty: no peering)."
  default     = ""
}

variable "control_plane_vpc_cidr" {
  type        = string
  description = "The control plane VPC's address range (outside 10.100.0.0-10.249.255.255, the runs' own)."
  default     = ""
}

variable "control_plane_route_table_ids" {
  type        = list(string)
  description = "The control plane's route tables that get a route to the run's VPC."
  default     = []
}

variable "ssh_allowed_cidrs" {
  type        = list(string)
  description = "Operator networks allowed on SSH."
  default     = []
}

variable "checkpoint_bucket" {
  type        = string
  description = "S3 bucket of the durable checkpoint store; the nodes may use only this run's prefix. Empty = no store."
  default     = ""
}

variable "checkpoint_prefix" {
  type        = string
  description = "Key prefix of the store in checkpoint_bucket."
  default     = "oolong"
}

variable "server_port_range" {
  type        = object({ from = number, to = number })
  description = "Ports the nodes' servers and trainer listen on, open to the control plane."
  default     = { from = 30000, to = 30999 }
}


variable "oolong_build" {
  type = object({
    wheel              = object({ url = string, sha256 = string })
    constraints        = object({ url = string, sha256 = string })
    sglang_constraints = object({ url = string, sha256 = string })
  })
  description = "The build the nodes install, each file's URL in the run's store and its sha256 (the flow publishes them: orchestration/builds.py)."
}

variable "node_key" {
  type        = string
  sensitive   = true
  description = "The run's node key (OOLONG_NODE_KEY): only this run's nodes open the credentials the flow seals with it."
}

variable "prefect_api_auth_string" {
  type        = string
  sensitive   = true
  description = "The Prefect API's basic-auth credential the nodes' workers present (the flow's PREFECT_API_AUTH_STRING)."
}

variable "efa" {
  type        = bool
  description = "EFA interfaces on instance types that have them (p4d, p5); false: NCCL over TCP."
  default     = true
}

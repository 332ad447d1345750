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

variable "ssh_allowed_cidrs" {
  type        = list(string)
  description = "Operator networks allowed on SSH."
  default     = []
}

variable "name" {
  type        = string
  description = "Name prefix for the control plane's resources."
}

variable "region" {
  type        = string
  description = "Cloud region."
}

variable "vpc_id" {
  type        = string
  description = "VPC to place the control plane in."
}

variable "subnet_ids" {
  type        = list(string)
  description = "At least two private subnets in different zones (managed databases need two)."
}

variable "app_subnet_id" {
  type        = string
  description = "Subnet of the application host (web app, Celery workers, Prefect server)."
}

variable "app_instance_type" {
  type        = string
  description = "Instance type of the application host."
  default     = "m6i.large"
}

variable "db_instance_class" {
  type        = string
  description = "PostgreSQL instance class (tracker, web app, Prefect server)."
  default     = "db.t4g.medium"
}

variable "db_storage_gb" {
  type        = number
  description = "PostgreSQL storage in GB; metric points grow with runs."
  default     = 100
}

variable "redis_node_type" {
  type        = string
  description = "Redis node type (Celery broker and results)."
  default     = "cache.t4g.small"
}

variable "admin_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the web app (HTTPS)."
  default     = []
}

variable "tags" {
  type        = map(string)
  description = "Extra tags for every resource."
  default     = {}
}

{{- define "tokenfab.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "tokenfab.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tokenfab.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{/* The roles the topology's pools use, sorted. */}}
{{- define "tokenfab.roles" -}}
{{- $roles := list -}}
{{- range .Values.topology.pools -}}{{- $roles = append $roles .role -}}{{- end -}}
{{- $roles | uniq | sortAlpha | toJson -}}
{{- end -}}

{{/*
The topology Ray Serve runs: the user's, with what Kubernetes decides filled in (the cluster
section, the gateway's bind address) and each pool's replicas placed on its role's worker group
through the Ray resource `tokenfab-<role>`. Fails when a pool needs more GPUs than its group's pods
have.
*/}}
{{- define "tokenfab.topology" -}}
{{- $t := deepCopy .Values.topology -}}
{{- $pools := list -}}
{{- range $pool := $t.pools -}}
{{- $group := index $.Values.workerGroups $pool.role | default dict -}}
{{- $resources := $pool.resources | default dict -}}
{{- $need := int ($resources.gpus | default 0) -}}
{{- $have := int ($group.gpusPerPod | default 0) -}}
{{- $parallel := $pool.parallel | default dict -}}
{{- if eq ($parallel.backend | default "mp") "ray" -}}
{{- /* vLLM places the ranks across the group's pods itself: a rank's tensor group on one pod */ -}}
{{- $tensor := int ($parallel.tensor | default 1) -}}
{{- if gt $tensor $have -}}
{{- fail (printf "topology.pools[%s] puts each rank's %d GPU(s) on one pod (parallel.backend ray), but workerGroups.%s.gpusPerPod is %d" $pool.name $tensor $pool.role $have) -}}
{{- end -}}
{{- $all := mul $need (int ($pool.replicas | default 1)) -}}
{{- $pods := mul $have (int ($group.replicas | default 0)) -}}
{{- if gt $all $pods -}}
{{- fail (printf "topology.pools[%s] needs %d GPUs across pods (parallel.backend ray), but workerGroups.%s has %d (replicas x gpusPerPod)" $pool.name $all $pool.role $pods) -}}
{{- end -}}
{{- else if gt $need $have -}}
{{- fail (printf "topology.pools[%s] needs %d GPU(s) per replica, but workerGroups.%s.gpusPerPod is %d" $pool.name $need $pool.role $have) -}}
{{- end -}}
{{- $placement := dict (printf "tokenfab-%s" $pool.role) 1 -}}
{{- $_ := set $resources "ray_resources" (merge (deepCopy ($resources.ray_resources | default dict)) $placement) -}}
{{- $_ := set $resources "pin_cores" false -}}
{{- $_ := set $pool "resources" $resources -}}
{{- $pools = append $pools $pool -}}
{{- end -}}
{{- $_ := set $t "pools" $pools -}}
{{- $gateway := $t.gateway | default dict -}}
{{- $_ := set $gateway "host" "0.0.0.0" -}}
{{- $_ := set $t "gateway" $gateway -}}
{{- $auth := $t.auth | default dict -}}
{{- if .Values.tenantKeys -}}
{{- $_ := set $auth "key_file" "/etc/tokenfab-secrets/tenant-keys.yaml" -}}
{{- end -}}
{{- if .Values.adminKeys -}}
{{- $_ := set $auth "admin_key_file" "/etc/tokenfab-secrets/admin-keys.yaml" -}}
{{- end -}}
{{- if (.Values.saltKeySecret | default dict).name -}}
{{- $_ := set $auth "salt_key_file" (printf "/etc/tokenfab-salt/%s" (.Values.saltKeySecret.key | default "salt-key")) -}}
{{- end -}}
{{- if $auth -}}
{{- $_ := set $t "auth" $auth -}}
{{- end -}}
{{- $head := printf "%s-head-svc" (include "tokenfab.fullname" .) -}}
{{- $_ := set $t "cluster" (dict "node_ip" nil "address" (printf "%s:6379" $head) "dashboard_url" (printf "http://%s:8265" $head)) -}}
{{- toYaml $t -}}
{{- end -}}

{{- define "tokenfab.gatewayPort" -}}
{{- (.Values.topology.gateway | default dict).port | default 8000 -}}
{{- end -}}

{{/* "true" when the autoscaler sizes the pool (as Topology.autoscaled): args (list topology pool) */}}
{{- define "tokenfab.autoscaled" -}}
{{- $t := index . 0 -}}
{{- $pool := index . 1 -}}
{{- $enabled := ne (toString ($t.autoscaler | default dict).enabled) "false" -}}
{{- if and $enabled (hasKey $pool "min_replicas") (hasKey $pool "max_replicas") -}}
{{- if and (ne (toString $pool.min_replicas) "<nil>") (ne (toString $pool.max_replicas) "<nil>") (lt (int $pool.min_replicas) (int $pool.max_replicas)) -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

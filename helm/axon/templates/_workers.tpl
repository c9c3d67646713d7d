{{/* A worker pool's pod template (workers.yaml), for its Deployment (role "") or for the leader
     ("leader") and the followers ("follower") of its LeaderWorkerSet. (dict "ctx" $ "c" labels-dict
     "p" pool "role" ... "gpu" bool "grace" int "drain" int "fixed" env "resources" ... "nodeSelector"
     ... "tolerations" ... "affinity" ... "groupEnv" non-AXON env of a multi-node pod) */}}
{{- define "axon.workerPodTemplate" -}}
{{- $ := .ctx -}}
{{- $p := .p -}}
{{- $mn := $p.multiNode -}}
{{- $rayPort := 6379 -}}
{{- $objectStore := mul (int $mn.rayObjectStoreGiB) 1073741824 -}}
metadata:
  labels:
    {{- include "axon.labels" .c | nindent 4 }}
    {{- if .role }}
    axon.io/role: {{ .role }}
    {{- end }}
  {{- with $p.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "axon.podSecurity" $ | nindent 2 }}
  # Longer than AXON_DRAIN_TIMEOUT_S: in-flight jobs finish or go back to the queue.
  terminationGracePeriodSeconds: {{ .grace }}
  containers:
    - name: worker
      image: {{ include "axon.image" (dict "ctx" $ "image" (ternary $.Values.images.workerGpu $.Values.images.workerCpu .gpu)) }}
      imagePullPolicy: {{ $.Values.images.pullPolicy }}
      {{- if eq .role "leader" }}
      # The group's Ray head, then the worker: its engine (AXON_DISTRIBUTED_EXECUTOR=ray) joins
      # this Ray cluster and waits, up to vLLM's placement-group timeout, for the followers' GPUs.
      command:
        - /bin/sh
        - -c
        - >-
          ray start --head --port={{ $rayPort }} --disable-usage-stats --include-dashboard=false
          --object-store-memory={{ $objectStore }}
          && export RAY_ADDRESS=auto
          && exec axon-worker
      {{- else if eq .role "follower" }}
      # Joins the leader's Ray cluster once its head answers (the leader may start later), then
      # holds this node's GPUs for the leader's engine; it exits when Ray does, and the group
      # is recreated.
      command:
        - /bin/sh
        - -c
        - >-
          head="$LWS_LEADER_ADDRESS:{{ $rayPort }}"; waited=0;
          until ray health-check --address "$head" >/dev/null 2>&1; do
          if [ "$waited" -ge {{ int $p.progressDeadlineSeconds }} ]; then echo "no Ray head at $head after ${waited}s" >&2; exit 1; fi;
          sleep 5; waited=$((waited + 5));
          done;
          exec ray start --address="$head" --block --disable-usage-stats
          --object-store-memory={{ $objectStore }}
      {{- else }}
      command: ["axon-worker"]
      {{- end }}
      {{- if ne .role "follower" }}
      ports:
        - name: http
          containerPort: {{ int $.Values.worker.port }}
          protocol: TCP
      {{- end }}
      env:
        {{- if ne .role "follower" }}
        {{- include "axon.env" (dict "ctx" $ "env" $p.env "fixed" .fixed) | nindent 8 }}
        - name: AXON_WORKER_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- include "axon.secretEnv" (dict "name" "AXON_REDIS_URL" "ref" $.Values.secrets.redisUrl) | nindent 8 }}
        {{- include "axon.secretEnv" (dict "name" "AXON_AMQP_URL" "ref" $.Values.secrets.amqpUrl) | nindent 8 }}
        {{- include "axon.secretEnv" (dict "name" "AXON_INTERNAL_TOKEN" "ref" $.Values.secrets.internalToken) | nindent 8 }}
        {{- end }}
        {{- with .groupEnv }}
        {{- include "axon.envFromMap" . | trim | nindent 8 }}
        {{- end }}
        {{- if $p.hfToken.name }}
        {{- include "axon.secretEnv" (dict "name" "HF_TOKEN" "ref" $p.hfToken) | nindent 8 }}
        {{- end }}
      {{- if ne .role "follower" }}
      {{- include "axon.probes" $p.readinessProbe | nindent 6 }}
      # Liveness starts once /health has answered, up to progressDeadlineSeconds: the model loads
      # off the worker's event loop, so /health answers meanwhile, but a liveness restart during a
      # start of minutes would begin the load again (for a multi-node pool, recreate its group).
      startupProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: {{ div (int $p.progressDeadlineSeconds) 10 }}
      {{- else }}
      lifecycle:
        # Ray stays up on this node while the leader drains its jobs.
        preStop:
          sleep:
            seconds: {{ add .drain 5 }}
      {{- end }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      securityContext:
        {{- toYaml $.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: /cache
        # Libraries that write under ~ (vLLM, triton, flashinfer) despite the read-only root.
        - name: home
          mountPath: /home/axon
        {{- if .gpu }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
  volumes:
    - name: tmp
      emptyDir:
        {{- if $mn.enabled }}
        # Ray's session directory (logs, spilled objects) is under /tmp.
        sizeLimit: 20Gi
        {{- else }}
        sizeLimit: 2Gi
        {{- end }}
    - name: home
      emptyDir:
        sizeLimit: 1Gi
    - name: cache
      {{- if $p.cache.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $p.cache.existingClaim }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $p.cache.sizeLimit }}
      {{- end }}
    {{- if .gpu }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $p.shmSize }}
    {{- end }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}


{{/* AXON_COLD_START_WAITS as JSON: model -> seconds for each pool that KEDA may scale to zero
     (keda.enabled, keda.minReplicas 0), its LoRA adapters included; {} when none does. The
     session manager queues a request for such a model for that long instead of answering 503. */}}
{{- define "axon.coldStartWaits" -}}
{{- $waits := dict -}}
{{- range $poolName := keys .Values.worker.pools | sortAlpha -}}
{{- $p := include "axon.workerPool" (dict "ctx" $ "name" $poolName) | fromYaml -}}
{{- if and $p.keda.enabled (eq (int $p.keda.minReplicas) 0) -}}
{{- $_ := set $waits $p.model (int $p.coldStartWaitSeconds) -}}
{{- range $p.lora.adapters }}{{- $_ := set $waits .name (int $p.coldStartWaitSeconds) -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $waits -}}
{{- end -}}

{{/* AXON_COLD_START_ADAPTERS as JSON: adapter -> base model for the LoRA adapters of the pools
     that KEDA may scale to zero; {} when none. A request for one then waits in its base model's
     queue, which wakes the pool, even before any of its workers has announced the adapter. */}}
{{- define "axon.coldStartAdapters" -}}
{{- $bases := dict -}}
{{- range $poolName := keys .Values.worker.pools | sortAlpha -}}
{{- $p := include "axon.workerPool" (dict "ctx" $ "name" $poolName) | fromYaml -}}
{{- if and $p.keda.enabled (eq (int $p.keda.minReplicas) 0) -}}
{{- range $p.lora.adapters }}{{- $_ := set $bases .name $p.model -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $bases -}}
{{- end -}}


{{/* Fails unless each LoRA adapter name means one model across the pools: an adapter is a model
     name of its own (in /v1/models, in the registry), so it may not be another pool's model, and
     pools listing the same adapter must serve the same base model (its jobs go to that model's
     queue). A pool's own model and adapters are checked with the pool (workers.yaml). */}}
{{- define "axon.validateAdapters" -}}
{{- $pools := dict -}}
{{- range $poolName := keys .Values.worker.pools | sortAlpha -}}
{{- $_ := set $pools $poolName (include "axon.workerPool" (dict "ctx" $ "name" $poolName) | fromYaml) -}}
{{- end -}}
{{- $models := dict -}}
{{- range $poolName, $p := $pools }}{{- $_ := set $models (toString $p.model) $poolName -}}{{- end -}}
{{- $bases := dict -}}
{{- range $poolName, $p := $pools -}}
{{- range $p.lora.adapters -}}
{{- if and (hasKey $models .name) (ne (toString $p.model) .name) -}}
{{- fail (printf "worker pool %s: lora adapter %s is the model of pool %s: each adapter is a model name of its own" $poolName .name (get $models .name)) -}}
{{- end -}}
{{- if and (hasKey $bases .name) (ne (index $bases .name 1) (toString $p.model)) -}}
{{- fail (printf "worker pool %s: lora adapter %s runs on %s here and on %s in pool %s: an adapter name has one base model, whose queue its requests go to" $poolName .name $p.model (index $bases .name 1) (index $bases .name 0)) -}}
{{- end -}}
{{- $_ := set $bases .name (list $poolName (toString $p.model)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
